#include "base/files.h"

#include <sys/stat.h>

#include <cerrno>

#include "base/strings.h"

namespace launch {

Status MakeDirs(const std::string& path) {
  std::string cur;
  for (const std::string& part : Split(path, '/')) {
    cur += part;
    cur += '/';
    if (part.empty()) continue;
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST)
      return Status::FromErrno("cannot create folder " + cur, errno);
  }
  return Status::Ok();
}

}  // namespace launch
