#pragma once

// The subcommands' command lines (subcommands.h's table: `launch config`, `launch env`,
// `launch rdzv-server`), all through CLI11 with one wording of errors. Its own unit, below the
// subcommands, so that they include it and not the table that names them.

#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace launch::launcher {

// Parses `args` into `app`; returns -1 to go on, else the exit code to return (0 after printing
// --help, 2 after "launch NAME: unknown argument 'X'" or CLI11's error, with a pointer to
// --help).
int ParseSubcommandArgs(CLI::App& app, const std::string& name,
                        const std::vector<std::string>& args);

}  // namespace launch::launcher
