#pragma once

// What an ELF file asks the dynamic loader for, read without loading it.

#include <string>
#include <vector>

namespace launch {

// The DT_NEEDED entries of an ELF64 executable or shared library ("libc.so.6", ...), in file
// order, read from its .dynamic section through a read-only mapping. Empty for a file that is
// not ELF64, is statically linked, cannot be read, or is malformed (every offset is checked
// against the file's size).
std::vector<std::string> ElfNeededLibraries(const std::string& path);

}  // namespace launch
