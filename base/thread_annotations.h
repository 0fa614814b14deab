#pragma once

// Lock annotations in leveldb's style (port/thread_annotations.h), checked by clang's
// -Wthread-safety and empty under other compilers: a member says which mutex guards it
// (GUARDED_BY), a function which mutex it needs held (REQUIRES) or must not hold (EXCLUDES).
// They work with base/mutex.h's Mutex, whose type is a capability (std::mutex in libstdc++ is
// not). tests/thread_safety_test.sh compiles the annotated files with clang.

#if defined(__clang__)
#define LAUNCH_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define LAUNCH_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) LAUNCH_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY LAUNCH_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) LAUNCH_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) LAUNCH_THREAD_ANNOTATION(pt_guarded_by(x))
#define REQUIRES(...) LAUNCH_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define EXCLUDES(...) LAUNCH_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ACQUIRE(...) LAUNCH_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) LAUNCH_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) LAUNCH_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) LAUNCH_THREAD_ANNOTATION(assert_capability(x))
#define NO_THREAD_SAFETY_ANALYSIS LAUNCH_THREAD_ANNOTATION(no_thread_safety_analysis)
