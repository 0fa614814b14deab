#include "launcher/subcommands.h"

#include <CLI/CLI.hpp>
#include <boost/asio.hpp>
#include <csignal>
#include <iostream>

#include "base/environment.h"
#include "base/exit_code.h"
#include "base/files.h"
#include "base/strings.h"
#include "launcher/env_report.h"
#include "launcher/subcommand_args.h"
#include "launcher/wizard.h"
#include "rendezvous/server.h"

namespace launch::launcher {

const std::vector<Subcommand>& Subcommands() {
  static const std::vector<Subcommand> table = {
      {"config", "a config from questions or `default` (accelerate config)", RunConfigCommand},
      {"env", "machine, LibTorch, the config in effect (accelerate env)", RunEnvCommand},
      {"rdzv-server", "a standalone rendezvous server", RunRendezvousServerCommand},
  };
  return table;
}

const Subcommand* FindSubcommand(const std::string& name) {
  for (const Subcommand& s : Subcommands())
    if (name == s.name) return &s;
  return nullptr;
}

int RunRendezvousServerCommand(const std::vector<std::string>& args) {
  rendezvous::ServerOptions options;
  const std::map<std::string, std::string> env = CurrentEnvironment();
  auto token = env.find("LAUNCH_RDZV_TOKEN");
  if (token != env.end()) options.token = token->second;
  bool quiet = false;
  std::string argv_token;
  CLI::App app{
      "launch rdzv-server: a standalone rendezvous server, for jobs where no node should host it.\n"
      "Runs until SIGINT/SIGTERM, serving one job after another.",
      "launch rdzv-server"};
  options.port = -1;
  app.add_option("--port", options.port, "TCP port to listen on (0 = any free port, printed)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--host", options.host, "address to listen on ('::' for IPv6)")
      ->capture_default_str();
  app.add_option("--token", argv_token, "shared rendezvous secret (default: $LAUNCH_RDZV_TOKEN)");
  app.add_flag("--quiet", quiet, "do not log rendezvous events");
  if (int rc = ParseSubcommandArgs(app, "rdzv-server", args); rc >= 0) return rc;
  if (options.port < 0) {
    std::cerr << "launch rdzv-server: --port is required (see launch rdzv-server --help)\n";
    return kExitUsage;
  }
  if (!argv_token.empty()) {
    options.token = argv_token;
    std::cerr << "launch rdzv-server: warning: --token on the command line is visible to every "
                 "user of this machine (ps, /proc/PID/cmdline); set LAUNCH_RDZV_TOKEN instead\n";
  }
  if (!quiet)
    options.log = [](const std::string& line) {
      std::cerr << "[rdzv-server] " << line << std::endl;
    };
  RaiseDescriptorLimit();  // one descriptor per agent
  boost::asio::io_context io;
  auto server = rendezvous::RendezvousServer::Create(io, options);
  Status listen = server->Listen();
  if (!listen.ok()) {
    std::cerr << "launch rdzv-server: " << listen.message() << "\n";
    return kExitUsage;
  }
  if (options.token.empty() && !IsLoopbackHost(options.host))
    std::cerr << "launch rdzv-server: warning: listening on " << options.host
              << " without a rdzv_token; any host that reaches this port can join the job "
                 "(set --token or LAUNCH_RDZV_TOKEN)\n";
  std::cerr << "launch rdzv-server: listening on "
            << rendezvous::FormatEndpoint(options.host, server->port()) << std::endl;
  boost::asio::signal_set signals(io, SIGINT, SIGTERM);
  signals.async_wait([&](const boost::system::error_code& ec, int) {
    if (ec) return;
    server->Stop();
    io.stop();
  });
  io.run();
  return kExitOk;
}

}  // namespace launch::launcher
