#include "base/elf.h"

#include <elf.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

namespace launch {

std::vector<std::string> ElfNeededLibraries(const std::string& path) {
  std::vector<std::string> needed;
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return needed;
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
      st.st_size < static_cast<off_t>(sizeof(Elf64_Ehdr))) {
    close(fd);
    return needed;
  }
  size_t size = static_cast<size_t>(st.st_size);
  void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED) return needed;
  const auto* base = static_cast<const unsigned char*>(map);
  const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(base);
  auto in_file = [&](uint64_t off, uint64_t len) { return off <= size && len <= size - off; };
  if (std::memcmp(eh->e_ident, ELFMAG, SELFMAG) == 0 && eh->e_ident[EI_CLASS] == ELFCLASS64 &&
      in_file(eh->e_shoff, uint64_t(eh->e_shnum) * sizeof(Elf64_Shdr))) {
    const auto* sh = reinterpret_cast<const Elf64_Shdr*>(base + eh->e_shoff);
    for (int i = 0; i < eh->e_shnum; ++i) {
      if (sh[i].sh_type != SHT_DYNAMIC || sh[i].sh_link >= eh->e_shnum) continue;
      const Elf64_Shdr& strtab = sh[sh[i].sh_link];
      if (!in_file(sh[i].sh_offset, sh[i].sh_size) || !in_file(strtab.sh_offset, strtab.sh_size))
        break;
      const auto* dyn = reinterpret_cast<const Elf64_Dyn*>(base + sh[i].sh_offset);
      size_t count = sh[i].sh_size / sizeof(Elf64_Dyn);
      for (size_t j = 0; j < count && dyn[j].d_tag != DT_NULL; ++j) {
        if (dyn[j].d_tag != DT_NEEDED || dyn[j].d_un.d_val >= strtab.sh_size) continue;
        const char* s = reinterpret_cast<const char*>(base + strtab.sh_offset + dyn[j].d_un.d_val);
        needed.emplace_back(s, strnlen(s, strtab.sh_size - dyn[j].d_un.d_val));
      }
      break;
    }
  }
  munmap(map, size);
  return needed;
}

}  // namespace launch
