# Installation and the CMake package `launch`, for programs that link the trainer runtime:
#
#   cmake --install build --prefix P
#     P/bin/{launch, launch-exec, train}          launch finds the other two beside itself
#     P/libexec/launch/liblaunch-linebuf.so        preloaded into workers (agent/linebuf.c)
#     P/libexec/launch/python/sitecustomize.py     first on Python workers' PYTHONPATH, with
#     P/libexec/launch/liblaunch-pystack.so        its stack-dump helper (agent/python_shim/)
#     P/lib/liblaunch_{base,config,trainer}.a      and liblaunch_trainer_<folder>.a below it
#     P/include/launch/<folder>/<header>.h         includes stay repo-rooted: "config/loader.h",
#                                                  "trainer_runtime/api/accelerator.h"
#     P/lib/cmake/launch/launchConfig.cmake        find_package(launch) -> launch::base,
#                                                  launch::config, launch::trainer
#
#   find_package(launch REQUIRED)                  # in the consumer's CMakeLists.txt
#   target_link_libraries(app PRIVATE launch::trainer)
#
# The libraries are static, so the package also finds what they link (launchConfig.cmake.in).
# Included last by the top-level CMakeLists.txt, once every target exists.

include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(LAUNCH_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/launch)
set(LAUNCH_INSTALL_INCLUDEDIR ${CMAKE_INSTALL_INCLUDEDIR}/launch)

# What a user of the package sees. The headers are the contracts of launch::base,
# launch::config and launch::trainer; what they include comes along (see below).
set(_launch_libraries launch_base launch_config)
set(_launch_programs launch launch-exec)
set(_launch_public_headers
  base/status.h
  base/check.h
  config/train_config.h
  config/launch_config.h
  config/loader.h)
if(LAUNCH_BUILD_TRAINER)
  # launch::trainer is api/; the folders below it come along as launch::trainer_<folder>.
  list(APPEND _launch_libraries launch_trainer launch_trainer_parallel launch_trainer_state
       launch_trainer_data launch_trainer_model launch_trainer_comm launch_trainer_compat
       launch_trainer_util)
  list(APPEND _launch_programs train)
  list(APPEND _launch_public_headers
    trainer_runtime/api/accelerator.h
    trainer_runtime/api/loader_cursor.h
    trainer_runtime/util/env.h
    trainer_runtime/data/sampler.h
    trainer_runtime/data/idx.h
    trainer_runtime/model/pipeline_stages.h
    trainer_runtime/model/activation_checkpoint.h
    trainer_runtime/model/shard_unit.h
    trainer_runtime/model/split_backward.h
    trainer_runtime/model/sync_batchnorm.h)
endif()

# launch_base -> launch::base, ...
foreach(lib IN LISTS _launch_libraries)
  string(REGEX REPLACE "^launch_" "" export_name ${lib})
  set_target_properties(${lib} PROPERTIES EXPORT_NAME ${export_name})
endforeach()

# In the tree, launch_base carries `PUBLIC ${CMAKE_SOURCE_DIR}` as its include directory. An
# exported target may not name a source path, so every plain absolute path is kept for the
# build only; installed, the include directory is P/include/launch (INCLUDES DESTINATION).
foreach(lib IN LISTS _launch_libraries)
  get_target_property(dirs ${lib} INTERFACE_INCLUDE_DIRECTORIES)
  if(NOT dirs)
    continue()
  endif()
  set(build_only)
  foreach(dir IN LISTS dirs)
    if(IS_ABSOLUTE "${dir}")
      list(APPEND build_only "$<BUILD_INTERFACE:${dir}>")
    else()
      list(APPEND build_only "${dir}")  # already a generator expression
    endif()
  endforeach()
  set_target_properties(${lib} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${build_only}")
endforeach()

install(TARGETS ${_launch_libraries}
  EXPORT launchTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${LAUNCH_INSTALL_INCLUDEDIR})
install(TARGETS ${_launch_programs} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS launch_linebuf LIBRARY DESTINATION ${LAUNCH_LIBEXEC_SUBDIR})
install(TARGETS launch_pystack LIBRARY DESTINATION ${LAUNCH_LIBEXEC_SUBDIR})
install(FILES ${CMAKE_SOURCE_DIR}/agent/python_shim/sitecustomize.py
        DESTINATION ${LAUNCH_LIBEXEC_SUBDIR}/python)

# Headers keep their folder under P/include/launch. With each public header goes every project
# header it includes ("x/y.h", rooted at the repository), followed transitively when installing,
# not when configuring: an #include added to accelerator.h then cannot leave the installed set
# incomplete, and no reconfigure is needed to notice it. An include that names no file of the
# repository (a shim or generated header) fails the install, naming both files.
install(CODE "set(_launch_source_dir \"${CMAKE_SOURCE_DIR}\")
set(_launch_public_headers \"${_launch_public_headers}\")
set(_launch_includedir \"${LAUNCH_INSTALL_INCLUDEDIR}\")")
install(CODE [[
  # A function, so that its variables stay out of the scope cmake_install.cmake shares.
  function(_launch_install_headers)
    set(pending ${_launch_public_headers})
    set(seen ${_launch_public_headers})
    while(pending)
      list(POP_FRONT pending header)
      set(source "${_launch_source_dir}/${header}")
      file(STRINGS "${source}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"[^\"]+\"")
      foreach(line IN LISTS lines)
        string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*" "\\1" included
               "${line}")
        if(NOT EXISTS "${_launch_source_dir}/${included}")
          message(FATAL_ERROR "installing ${header}: it includes \"${included}\", which is not "
                              "a header of the repository (includes are rooted at its top)")
        endif()
        list(FIND seen "${included}" index)  # not IN_LIST: install scripts run with old policies
        if(index EQUAL -1)
          list(APPEND seen ${included})
          list(APPEND pending ${included})
        endif()
      endforeach()
      get_filename_component(folder "${header}" DIRECTORY)
      file(INSTALL DESTINATION "${CMAKE_INSTALL_PREFIX}/${_launch_includedir}/${folder}"
           TYPE FILE FILES "${source}")
    endwhile()
  endfunction()
  _launch_install_headers()
]])

install(EXPORT launchTargets
  NAMESPACE launch::
  DESTINATION ${LAUNCH_INSTALL_CMAKEDIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/launchConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/launchConfig.cmake
  INSTALL_DESTINATION ${LAUNCH_INSTALL_CMAKEDIR})
# 0.x: a new minor version may change the API, so only the same minor version is compatible.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/launchConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${CMAKE_CURRENT_BINARY_DIR}/launchConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/launchConfigVersion.cmake
  DESTINATION ${LAUNCH_INSTALL_CMAKEDIR})
