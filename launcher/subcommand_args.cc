#include "launcher/subcommand_args.h"

#include <CLI/CLI.hpp>
#include <iostream>

#include "base/exit_code.h"

namespace launch::launcher {

int ParseSubcommandArgs(CLI::App& app, const std::string& name,
                        const std::vector<std::string>& args) {
  app.allow_extras();
  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return kExitOk;
  } catch (const CLI::ParseError& e) {
    std::cerr << "launch " << name << ": " << e.what() << " (see launch " << name << " --help)\n";
    return kExitUsage;
  }
  if (!app.remaining().empty()) {
    std::cerr << "launch " << name << ": unknown argument '" << app.remaining().front()
              << "' (see launch " << name << " --help)\n";
    return kExitUsage;
  }
  return -1;
}

}  // namespace launch::launcher
