#include "config/hostfile.h"

#include <algorithm>
#include <cctype>

#include "base/files.h"
#include "base/strings.h"
#include "config/limits.h"

namespace launch::config {
namespace {

constexpr size_t kMaxHostfileBytes = 1 << 20;

// A host reaches ssh's command line and every node's --main_process_ip: letters, digits and
// ". _ - @" only, never a leading '-' (ssh would take it as an option). "" when fine.
std::string CheckHost(const std::string& host) {
  if (host.empty()) return "empty host name";
  if (host[0] == '-' || host[0] == '.' || host[0] == '@')
    return "'" + host + "' is not a host name";
  for (char ch : host)
    if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '-' || ch == '_' ||
          ch == '@'))
      return "'" + SanitizeForTerminal(host) +
             "' is not a host name (letters, digits, '.', '-', '_', user@ allowed; an IPv6 "
             "address needs a name in ~/.ssh/config)";
  return "";
}

std::string ParseSlots(const std::string& text, int* slots) {
  long long v = 0;
  if (!ParseInt64(text, &v) || v < 1 || v > kMaxWorkersPerNode)
    return "slots must be an integer from 1 to " + std::to_string(kMaxWorkersPerNode) + ", got '" +
           SanitizeForTerminal(text) + "'";
  *slots = static_cast<int>(v);
  return "";
}

// The host part without "user@": two entries for one machine under different users are still
// one machine (its ports and slots would collide).
std::string MachineOf(const std::string& host) {
  size_t at = host.rfind('@');
  return ToLower(at == std::string::npos ? host : host.substr(at + 1));
}

Status AddHost(HostSlots entry, std::vector<HostSlots>* out) {
  for (const HostSlots& h : *out)
    if (MachineOf(h.host) == MachineOf(entry.host))
      return Status::InvalidConfig(entry.where + ": host '" + entry.host +
                                   "' is already listed at " + h.where +
                                   " (give one line per host with all its slots)");
  out->push_back(std::move(entry));
  return Status::Ok();
}

}  // namespace

StatusOr<std::vector<HostSlots>> ParseHostfile(const std::string& text, const std::string& path) {
  std::vector<HostSlots> hosts;
  std::vector<std::string> lines = Split(text, '\n');
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string where = path + ":" + std::to_string(i + 1);
    std::string line = lines[i];
    size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    std::vector<std::string> fields;
    for (const std::string& f : Split(Trim(line), ' '))
      for (const std::string& g : Split(f, '\t'))
        if (!g.empty()) fields.push_back(g);
    if (fields.empty()) continue;
    if (fields.size() != 2 || !StartsWith(fields[1], "slots="))
      return Status::InvalidConfig(where + ": expected `HOST slots=N`, got '" +
                                   SanitizeForTerminal(Trim(line)) + "'");
    HostSlots h;
    h.host = fields[0];
    h.where = where;
    std::string err = CheckHost(h.host);
    if (err.empty()) err = ParseSlots(fields[1].substr(6), &h.slots);
    if (!err.empty()) return Status::InvalidConfig(where + ": " + err);
    LAUNCH_RETURN_IF_ERROR(AddHost(std::move(h), &hosts));
  }
  if (hosts.empty()) {
    size_t last = lines.size() - (EndsWith(text, "\n") ? 1 : 0);
    return Status::InvalidConfig(path + ":" + std::to_string(std::max<size_t>(last, 1)) +
                                 ": no host in the file (expected `HOST slots=N` lines)");
  }
  return hosts;
}

StatusOr<std::vector<HostSlots>> ParseHostList(const std::string& text) {
  std::vector<HostSlots> hosts;
  std::vector<std::string> entries = Split(text, ',');
  for (size_t i = 0; i < entries.size(); ++i) {
    std::string entry = Trim(entries[i]);
    HostSlots h;
    h.where = "entry " + std::to_string(i + 1) + " ('" + SanitizeForTerminal(entry) + "')";
    size_t colon = entry.rfind(':');
    h.host = entry.substr(0, colon);
    std::string err = CheckHost(h.host);
    if (err.empty() && colon != std::string::npos)
      err = ParseSlots(entry.substr(colon + 1), &h.slots);
    if (!err.empty()) return Status::InvalidConfig(h.where + ": " + err);
    LAUNCH_RETURN_IF_ERROR(AddHost(std::move(h), &hosts));
  }
  if (hosts.empty()) return Status::InvalidConfig("no host given (expected HOST:N,HOST:N)");
  return hosts;
}

StatusOr<std::vector<HostSlots>> LoadHostfile(const std::string& path) {
  StatusOr<std::string> text = ReadRegularFile(path, kMaxHostfileBytes);
  if (!text.ok()) return Status::InvalidConfig(text.status().message());
  return ParseHostfile(*text, path);
}

}  // namespace launch::config
