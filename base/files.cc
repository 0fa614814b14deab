#include "base/files.h"

#include <sys/resource.h>

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

namespace {
rlimit StartLimit() {
  rlimit lim{};
  getrlimit(RLIMIT_NOFILE, &lim);
  return lim;
}
const rlimit kStartNofile = StartLimit();  // before main(): before anyone raises it
}  // namespace

void RaiseDescriptorLimit() {
  rlimit lim = kStartNofile;
  if (lim.rlim_cur >= lim.rlim_max) return;
  lim.rlim_cur = lim.rlim_max;
  setrlimit(RLIMIT_NOFILE, &lim);
}

unsigned long long OriginalDescriptorLimit() {
  return static_cast<unsigned long long>(kStartNofile.rlim_cur);
}

}  // namespace launch
