#include "rendezvous/server_main.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include <boost/asio.hpp>

#include "base/files.h"
#include "base/strings.h"
#include "rendezvous/server.h"

namespace launch::rendezvous {
namespace {

constexpr char kUsage[] =
    "usage: launch rdzv-server --port PORT [--host ADDRESS] [--token SECRET] [--quiet]\n"
    "  --port PORT      TCP port to listen on (0 = any free port, printed at start)\n"
    "  --host ADDRESS   address to listen on (default 0.0.0.0; '::' for IPv6)\n"
    "  --token SECRET   shared rendezvous secret (default: $LAUNCH_RDZV_TOKEN)\n"
    "  --quiet          do not log rendezvous events\n";

}  // namespace

int RunRendezvousServerCommand(int argc, char** argv) {
  ServerOptions options;
  options.port = -1;
  if (const char* token = std::getenv("LAUNCH_RDZV_TOKEN")) options.token = token;
  bool quiet = false, token_from_argv = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_value = false;
    size_t eq = arg.find('=');
    if (StartsWith(arg, "--") && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    auto take = [&](std::string* out) {
      if (has_value) {
        *out = value;
        return true;
      }
      if (i + 1 >= argc) return false;
      *out = argv[++i];
      return true;
    };
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return 0;
    } else if (arg == "--quiet") {
      quiet = true;
    } else if (arg == "--port" || arg == "--host" || arg == "--token") {
      std::string v;
      if (!take(&v)) {
        std::cerr << "launch rdzv-server: " << arg << " needs a value\n" << kUsage;
        return 2;
      }
      if (arg == "--port") {
        long long port = 0;
        if (!ParseInt64(v, &port) || port < 0 || port > 65535) {
          std::cerr << "launch rdzv-server: --port: expected a port number, got '" << v << "'\n";
          return 2;
        }
        options.port = static_cast<int>(port);
      } else if (arg == "--host") {
        options.host = v;
      } else {
        options.token = v;
        token_from_argv = true;
      }
    } else {
      std::cerr << "launch rdzv-server: unknown argument '" << argv[i] << "'\n" << kUsage;
      return 2;
    }
  }
  if (options.port < 0) {
    std::cerr << "launch rdzv-server: --port is required\n" << kUsage;
    return 2;
  }
  if (!quiet) {
    options.log = [](const std::string& line) {
      std::cerr << "[rdzv-server] " << line << std::endl;
    };
  }
  RaiseDescriptorLimit();  // one descriptor per agent
  if (token_from_argv)
    std::cerr << "launch rdzv-server: warning: --token on the command line is visible to every "
                 "user of this machine (ps, /proc/PID/cmdline); set LAUNCH_RDZV_TOKEN instead\n";
  boost::asio::io_context io;
  auto server = RendezvousServer::Create(io, options);
  Status listen = server->Listen();
  if (!listen.ok()) {
    std::cerr << "launch rdzv-server: " << listen.message() << "\n";
    return 2;
  }
  if (options.token.empty() && !IsLoopbackHost(options.host))
    std::cerr << "launch rdzv-server: warning: listening on " << options.host
              << " without a rdzv_token; any host that reaches this port can join the job "
                 "(set --token or LAUNCH_RDZV_TOKEN)\n";
  std::cerr << "launch rdzv-server: listening on " << FormatEndpoint(options.host, server->port())
            << std::endl;
  boost::asio::signal_set signals(io, SIGINT, SIGTERM);
  signals.async_wait([&](const boost::system::error_code& ec, int) {
    if (ec) return;
    server->Stop();
    io.stop();
  });
  io.run();
  return 0;
}

}  // namespace launch::rendezvous
