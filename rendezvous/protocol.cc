#include "rendezvous/protocol.h"

#include <chrono>

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "base/strings.h"
#include "config/limits.h"

namespace launch::rendezvous {
namespace {

void PutU16(std::string* out, uint16_t v) {
  out->push_back(static_cast<char>(v >> 8));
  out->push_back(static_cast<char>(v & 0xff));
}
void PutU32(std::string* out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8)
    out->push_back(static_cast<char>((v >> shift) & 0xff));
}
uint16_t GetU16(const uint8_t* p) { return static_cast<uint16_t>((p[0] << 8) | p[1]); }
uint32_t GetU32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

bool ValidKey(std::string_view key) {
  if (key.empty() || key.size() > kMaxKeySize) return false;
  for (char c : key) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  }
  return true;
}

// ---- field readers: every one bounds-checks and names the field on error ----

Status Missing(const std::string& key) {
  return Status::ProtocolError("missing field '" + key + "'");
}

Status GetString(const Fields& f, const std::string& key, size_t max_size, std::string* out,
                 bool required = true) {
  auto it = f.find(key);
  if (it == f.end()) return required ? Missing(key) : Status::Ok();
  if (it->second.size() > max_size)
    return Status::ProtocolError("field '" + key + "' is " + std::to_string(it->second.size()) +
                                 " bytes, more than " + std::to_string(max_size));
  *out = it->second;
  return Status::Ok();
}

Status GetInt(const Fields& f, const std::string& key, long long lo, long long hi, int* out,
              bool required = true) {
  auto it = f.find(key);
  if (it == f.end()) return required ? Missing(key) : Status::Ok();
  long long v = 0;
  if (it->second.size() > 24 || !ParseInt64(it->second, &v) || v < lo || v > hi)
    return Status::ProtocolError("field '" + key + "' is not an integer in [" + std::to_string(lo) +
                                 ", " + std::to_string(hi) + "]");
  *out = static_cast<int>(v);
  return Status::Ok();
}

// An optional 64-bit count (microseconds since the epoch); absent = 0, as older agents send.
Status GetMicros(const Fields& f, const std::string& key, int64_t* out) {
  auto it = f.find(key);
  if (it == f.end()) return Status::Ok();
  long long v = 0;
  if (it->second.size() > 24 || !ParseInt64(it->second, &v) || v < 0)
    return Status::ProtocolError("field '" + key + "' is not a non-negative integer");
  *out = v;
  return Status::Ok();
}

Status GetSeconds(const Fields& f, const std::string& key, double* out) {
  auto it = f.find(key);
  if (it == f.end()) return Missing(key);
  double v = 0;
  if (it->second.size() > 32 || !ParseDouble(it->second, &v) || !std::isfinite(v) || v < 0 ||
      v > 1e7)
    return Status::ProtocolError("field '" + key + "' is not a duration in seconds");
  *out = v;
  return Status::Ok();
}

Status GetBool(const Fields& f, const std::string& key, bool* out, bool required = true) {
  auto it = f.find(key);
  if (it == f.end()) return required ? Missing(key) : Status::Ok();
  if (it->second != "0" && it->second != "1")
    return Status::ProtocolError("field '" + key + "' is not 0 or 1");
  *out = it->second == "1";
  return Status::Ok();
}

std::string SecondsString(double s) {
  std::ostringstream os;
  os.precision(17);
  os << s;
  return os.str();
}

void PutReport(const FailureReport& r, const std::string& prefix, Fields* f) {
  (*f)[prefix + "round"] = std::to_string(r.round);
  (*f)[prefix + "host"] = r.host;
  (*f)[prefix + "node_rank"] = std::to_string(r.node_rank);
  (*f)[prefix + "global_rank"] = std::to_string(r.global_rank);
  (*f)[prefix + "local_rank"] = std::to_string(r.local_rank);
  (*f)[prefix + "exit_code"] = std::to_string(r.exit_code);
  (*f)[prefix + "signal"] = std::to_string(r.signal);
  (*f)[prefix + "reason"] = r.reason.substr(0, kMaxShortString);
  std::string tail = r.stderr_tail;
  if (tail.size() > kMaxStderrTail) tail = tail.substr(tail.size() - kMaxStderrTail);
  (*f)[prefix + "stderr_tail"] = tail;
  (*f)[prefix + "time_us"] = std::to_string(r.time_us);
}

StatusOr<FailureReport> GetReport(const Fields& f, const std::string& prefix) {
  FailureReport r;
  constexpr long long kBig = 1LL << 30;
  LAUNCH_RETURN_IF_ERROR(GetInt(f, prefix + "round", 0, kBig, &r.round));
  LAUNCH_RETURN_IF_ERROR(GetString(f, prefix + "host", kMaxShortString, &r.host));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, prefix + "node_rank", -1, kMaxNodes, &r.node_rank));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, prefix + "global_rank", -1, kBig, &r.global_rank));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, prefix + "local_rank", -1, kBig, &r.local_rank));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, prefix + "exit_code", -1, 255, &r.exit_code));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, prefix + "signal", 0, 128, &r.signal));
  LAUNCH_RETURN_IF_ERROR(GetString(f, prefix + "reason", kMaxShortString, &r.reason));
  LAUNCH_RETURN_IF_ERROR(GetString(f, prefix + "stderr_tail", kMaxStderrTail, &r.stderr_tail));
  LAUNCH_RETURN_IF_ERROR(GetMicros(f, prefix + "time_us", &r.time_us));
  return r;
}

bool IsIpAddress(const std::string& s) {
  unsigned char buf[sizeof(in6_addr)];
  return inet_pton(AF_INET, s.c_str(), buf) == 1 || inet_pton(AF_INET6, s.c_str(), buf) == 1;
}

}  // namespace

const char* ToString(MessageType type) {
  switch (type) {
    case MessageType::kChallenge:
      return "CHALLENGE";
    case MessageType::kHello:
      return "HELLO";
    case MessageType::kWelcome:
      return "WELCOME";
    case MessageType::kJoin:
      return "JOIN";
    case MessageType::kAssign:
      return "ASSIGN";
    case MessageType::kHeartbeat:
      return "HEARTBEAT";
    case MessageType::kReport:
      return "REPORT";
    case MessageType::kSucceeded:
      return "SUCCEEDED";
    case MessageType::kRestart:
      return "RESTART";
    case MessageType::kDone:
      return "DONE";
    case MessageType::kFailed:
      return "FAILED";
    case MessageType::kError:
      return "ERROR";
    case MessageType::kReplace:
      return "REPLACE";
    case MessageType::kReplaced:
      return "REPLACED";
  }
  return "UNKNOWN";
}

bool IsHandshakeMessage(MessageType type) {
  return type == MessageType::kChallenge || type == MessageType::kHello ||
         type == MessageType::kWelcome || type == MessageType::kError;
}

uint32_t MaxPayload(MessageType type, Receiver receiver, int max_nodes) {
  // Each limit is the largest message of its type that the parser accepts, rounded up: strings
  // at their field's limit, integers at the 24 characters GetInt reads (protocol_test encodes
  // each such message and checks it fits).
  constexpr uint32_t kTiny = 64;        // HEARTBEAT, DONE, SUCCEEDED
  constexpr uint32_t kHandshake = 256;  // CHALLENGE, HELLO, WELCOME: a nonce or proof
  constexpr uint32_t kReport = kMaxStderrTail + 4096;  // + host, reason, numbers
  const bool to_server = receiver == Receiver::kServer;
  switch (type) {
    case MessageType::kHello:
      return to_server ? kHandshake : 0;
    case MessageType::kJoin:
      return to_server ? 4096 : 0;  // run_id 1 KiB, hostname, fingerprint 256 B each
    case MessageType::kReport:
      return to_server ? kReport : 0;
    case MessageType::kSucceeded:
      return to_server ? kTiny : 0;
    case MessageType::kHeartbeat:
      return kTiny;
    case MessageType::kChallenge:
    case MessageType::kWelcome:
      return to_server ? 0 : kHandshake;
    case MessageType::kError:
      return to_server ? 0 : kMaxShortString * 4 + 256;
    case MessageType::kDone:
      return to_server ? 0 : kTiny;
    case MessageType::kRestart:
      return to_server ? 0 : kReport + 4096;  // + a reason
    case MessageType::kFailed:
      return to_server ? 0 : kReport + 8192;  // + a 4 KiB message
    case MessageType::kReplace:
      return to_server ? 2048 : 0;  // a 1 KiB reason and two numbers
    case MessageType::kReplaced:
      return to_server ? 0 : 2048;  // a 1 KiB message and four numbers
    case MessageType::kAssign: {
      if (to_server) return 0;
      const uint64_t nodes = static_cast<uint64_t>(std::clamp(max_nodes, 1, kMaxNodes));
      return static_cast<uint32_t>(4096 + nodes * kMaxNodeRowSize);
    }
  }
  return 0;
}

StatusOr<FrameHeader> DecodeHeader(const uint8_t* data, uint32_t max_length) {
  if (std::memcmp(data, kMagic, sizeof(kMagic)) != 0)
    return Status::ProtocolError("not a launch rendezvous frame (bad magic)");
  uint16_t version = GetU16(data + 4);
  if (version != kProtocolVersion)
    return Status::ProtocolError("protocol version " + std::to_string(version) +
                                 " is not supported (this build speaks " +
                                 std::to_string(kProtocolVersion) + ")");
  uint16_t type = GetU16(data + 6);
  if (type < static_cast<uint16_t>(MessageType::kChallenge) ||
      type > static_cast<uint16_t>(kLastMessageType))
    return Status::ProtocolError("unknown message type " + std::to_string(type));
  uint32_t length = GetU32(data + 8);
  if (length > max_length)
    return Status::ProtocolError("frame of " + std::to_string(length) +
                                 " bytes exceeds the limit of " + std::to_string(max_length));
  FrameHeader h;
  h.type = static_cast<MessageType>(type);
  h.length = length;
  return h;
}

StatusOr<Fields> DecodeFields(std::string_view payload) {
  const auto* p = reinterpret_cast<const uint8_t*>(payload.data());
  size_t n = payload.size(), pos = 0;
  if (n > kMaxPayloadSize) return Status::ProtocolError("payload too large");
  if (n < 2) return Status::ProtocolError("payload shorter than its field count");
  size_t count = GetU16(p);
  pos = 2;
  if (count > kMaxFields)
    return Status::ProtocolError(std::to_string(count) + " fields exceed the limit of " +
                                 std::to_string(kMaxFields));
  Fields fields;
  for (size_t i = 0; i < count; ++i) {
    if (n - pos < 1) return Status::ProtocolError("truncated key length");
    size_t key_len = p[pos++];
    if (key_len == 0 || key_len > kMaxKeySize || n - pos < key_len)
      return Status::ProtocolError("bad key length " + std::to_string(key_len));
    std::string key(payload.substr(pos, key_len));
    pos += key_len;
    if (!ValidKey(key)) return Status::ProtocolError("bad key (allowed: a-z 0-9 _)");
    if (n - pos < 4) return Status::ProtocolError("truncated value length for '" + key + "'");
    size_t value_len = GetU32(p + pos);
    pos += 4;
    if (value_len > n - pos)
      return Status::ProtocolError("value of '" + key + "' runs past the end of the frame");
    // Keys strictly ascending: one canonical encoding, no duplicates.
    if (!fields.empty() && !(fields.rbegin()->first < key))
      return Status::ProtocolError("field '" + key + "' is duplicated or out of order");
    fields.emplace_hint(fields.end(), key, std::string(payload.substr(pos, value_len)));
    pos += value_len;
  }
  if (pos != n) return Status::ProtocolError("trailing bytes after the last field");
  return fields;
}

std::string EncodeFields(const Fields& fields) {
  LAUNCH_CHECK(fields.size() <= kMaxFields, "too many fields");
  std::string out;
  PutU16(&out, static_cast<uint16_t>(fields.size()));
  for (const auto& [key, value] : fields) {
    LAUNCH_CHECK(ValidKey(key), "invalid field key '" + key + "'");
    out.push_back(static_cast<char>(key.size()));
    out += key;
    PutU32(&out, static_cast<uint32_t>(value.size()));
    out += value;
  }
  return out;
}

std::string EncodeFrame(MessageType type, const Fields& fields, size_t mac_size) {
  std::string payload = EncodeFields(fields);
  std::string out(kMagic, sizeof(kMagic));
  PutU16(&out, kProtocolVersion);
  PutU16(&out, static_cast<uint16_t>(type));
  // Saturates, so an oversized message is refused by the limit checks, never wrapped around.
  size_t length = payload.size() + mac_size;
  PutU32(&out, length > UINT32_MAX ? UINT32_MAX : static_cast<uint32_t>(length));
  out += payload;
  return out;
}

StatusOr<Frame> DecodeFrame(std::string_view bytes) {
  if (bytes.size() < kHeaderSize) return Status::ProtocolError("truncated frame header");
  LAUNCH_ASSIGN_OR_RETURN(FrameHeader h,
                          DecodeHeader(reinterpret_cast<const uint8_t*>(bytes.data())));
  if (bytes.size() - kHeaderSize != h.length)
    return Status::ProtocolError("frame length does not match its header");
  Frame frame;
  frame.type = h.type;
  LAUNCH_ASSIGN_OR_RETURN(frame.fields, DecodeFields(bytes.substr(kHeaderSize)));
  return frame;
}

// ---- typed messages ----

Fields ToFields(const Hello& m) { return {{"nonce", m.nonce}, {"proof", m.proof}}; }

StatusOr<Hello> ParseHello(const Fields& f) {
  Hello m;
  LAUNCH_RETURN_IF_ERROR(GetString(f, "nonce", kNonceSize, &m.nonce));
  LAUNCH_RETURN_IF_ERROR(GetString(f, "proof", 64, &m.proof));
  if (m.nonce.size() != kNonceSize) return Status::ProtocolError("field 'nonce' has a bad size");
  return m;
}

Fields ToFields(const JoinRequest& m) {
  return {{"run_id", m.run_id},
          {"min_nodes", std::to_string(m.min_nodes)},
          {"max_nodes", std::to_string(m.max_nodes)},
          {"node_rank", std::to_string(m.node_rank)},
          {"local_world_size", std::to_string(m.local_world_size)},
          {"master_port", std::to_string(m.master_port)},
          {"hostname", m.hostname},
          {"fingerprint", m.fingerprint},
          {"max_restarts", std::to_string(m.max_restarts)},
          {"join_timeout", SecondsString(m.join_timeout_s)},
          {"last_call_timeout", SecondsString(m.last_call_timeout_s)},
          {"heartbeat_timeout", SecondsString(m.heartbeat_timeout_s)},
          {"clock_us", std::to_string(m.clock_us)},
          {"recover_in_place", m.recover_in_place ? "1" : "0"}};
}

StatusOr<JoinRequest> ParseJoin(const Fields& f) {
  JoinRequest m;
  LAUNCH_RETURN_IF_ERROR(GetString(f, "run_id", config::kMaxRunIdBytes, &m.run_id));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "min_nodes", 1, kMaxNodes, &m.min_nodes));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "max_nodes", 1, kMaxNodes, &m.max_nodes));
  if (m.max_nodes < m.min_nodes) return Status::ProtocolError("max_nodes is below min_nodes");
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "node_rank", -1, kMaxNodes - 1, &m.node_rank));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "local_world_size", 1, 1 << 16, &m.local_world_size));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "master_port", 1, 65535, &m.master_port));
  LAUNCH_RETURN_IF_ERROR(GetString(f, "hostname", 256, &m.hostname));
  LAUNCH_RETURN_IF_ERROR(GetString(f, "fingerprint", 256, &m.fingerprint));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "max_restarts", 0, config::kMaxRestarts, &m.max_restarts));
  LAUNCH_RETURN_IF_ERROR(GetSeconds(f, "join_timeout", &m.join_timeout_s));
  LAUNCH_RETURN_IF_ERROR(GetSeconds(f, "last_call_timeout", &m.last_call_timeout_s));
  LAUNCH_RETURN_IF_ERROR(GetSeconds(f, "heartbeat_timeout", &m.heartbeat_timeout_s));
  LAUNCH_RETURN_IF_ERROR(GetMicros(f, "clock_us", &m.clock_us));
  LAUNCH_RETURN_IF_ERROR(GetBool(f, "recover_in_place", &m.recover_in_place, /*required=*/false));
  if (!IsPrintable(m.run_id) || !IsPrintable(m.hostname))
    return Status::ProtocolError("fields 'run_id' and 'hostname' must be printable text");
  if (m.heartbeat_timeout_s < config::kMinRendezvousTimeoutS ||
      m.join_timeout_s < config::kMinRendezvousTimeoutS)
    return Status::ProtocolError("heartbeat_timeout and join_timeout must be at least 0.05 s");
  return m;
}

Fields ToFields(const Assignment& m) {
  Fields f{{"round", std::to_string(m.round)},
           {"restart_count", std::to_string(m.restart_count)},
           {"max_restarts", std::to_string(m.max_restarts)},
           {"node_rank", std::to_string(m.node_rank)},
           {"num_nodes", std::to_string(m.num_nodes)},
           {"rank_offset", std::to_string(m.rank_offset)},
           {"local_world_size", std::to_string(m.local_world_size)},
           {"world_size", std::to_string(m.world_size)},
           {"master_addr", m.master_addr},
           {"master_port", std::to_string(m.master_port)},
           {"run_id", m.run_id}};
  if (m.generation > 0) f["generation"] = std::to_string(m.generation);
  if (m.lost_ms_ago > 0) f["lost_ms_ago"] = std::to_string(m.lost_ms_ago);
  // The node table is one field (tab-separated columns, one line per node) so a job of any
  // size stays within kMaxFields.
  std::string table;
  for (const NodeInfo& n : m.nodes) {
    table += std::to_string(n.node_rank) + "\t" + n.host + "\t" + n.address + "\t" +
             std::to_string(n.local_world_size) + "\t" + std::to_string(n.rank_offset) + "\n";
  }
  f["nodes"] = table;
  return f;
}

StatusOr<Assignment> ParseAssignment(const Fields& f) {
  Assignment m;
  constexpr long long kBig = 1LL << 30;
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "round", 0, kBig, &m.round));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "restart_count", 0, kBig, &m.restart_count));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "max_restarts", 0, kBig, &m.max_restarts));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "num_nodes", 1, kMaxNodes, &m.num_nodes));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "node_rank", 0, m.num_nodes - 1, &m.node_rank));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "world_size", 1, kBig, &m.world_size));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "local_world_size", 1, m.world_size, &m.local_world_size));
  LAUNCH_RETURN_IF_ERROR(
      GetInt(f, "rank_offset", 0, m.world_size - m.local_world_size, &m.rank_offset));
  LAUNCH_RETURN_IF_ERROR(GetString(f, "master_addr", 256, &m.master_addr));
  if (m.master_addr.empty()) return Status::ProtocolError("field 'master_addr' is empty");
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "master_port", 1, 65535, &m.master_port));
  LAUNCH_RETURN_IF_ERROR(GetString(f, "run_id", kMaxShortString, &m.run_id));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "generation", 0, kBig, &m.generation, /*required=*/false));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "lost_ms_ago", 0, kBig, &m.lost_ms_ago, /*required=*/false));
  // These two end up in the workers' environment (MASTER_ADDR, TORCHELASTIC_RUN_ID): accept
  // only an IP address and printable text.
  if (!IsIpAddress(m.master_addr))
    return Status::ProtocolError("field 'master_addr' is not an IP address");
  if (!IsPrintable(m.run_id)) return Status::ProtocolError("field 'run_id' is not printable text");
  std::string table;
  LAUNCH_RETURN_IF_ERROR(GetString(f, "nodes", kMaxPayloadSize, &table));
  for (const std::string& line : Split(table, '\n')) {
    if (line.empty()) continue;
    if (line.size() + 1 > kMaxNodeRowSize)
      return Status::ProtocolError("field 'nodes' has a line longer than " +
                                   std::to_string(kMaxNodeRowSize) + " bytes");
    std::vector<std::string> cols = Split(line, '\t');
    NodeInfo n;
    long long rank = 0, lws = 0, off = 0;
    if (cols.size() != 5 || !ParseInt64(cols[0], &rank) || !ParseInt64(cols[3], &lws) ||
        !ParseInt64(cols[4], &off) || rank < 0 || rank >= m.num_nodes || lws < 1 || off < 0 ||
        off > m.world_size)
      return Status::ProtocolError("field 'nodes' has a malformed line");
    n.node_rank = static_cast<int>(rank);
    n.host = cols[1];
    n.address = cols[2];
    n.local_world_size = static_cast<int>(lws);
    n.rank_offset = static_cast<int>(off);
    m.nodes.push_back(std::move(n));
    if (m.nodes.size() > static_cast<size_t>(m.num_nodes))
      return Status::ProtocolError("field 'nodes' lists more nodes than num_nodes");
  }
  return m;
}

Fields ToFields(const FailureReport& m) {
  Fields f;
  PutReport(m, "", &f);
  return f;
}

StatusOr<FailureReport> ParseFailureReport(const Fields& f) { return GetReport(f, ""); }

Fields ToFields(const ReplaceRequest& m) {
  return {{"round", std::to_string(m.round)},
          {"global_rank", std::to_string(m.global_rank)},
          {"reason", m.reason.substr(0, kMaxShortString)}};
}

StatusOr<ReplaceRequest> ParseReplaceRequest(const Fields& f) {
  ReplaceRequest m;
  constexpr long long kBig = 1LL << 30;
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "round", 0, kBig, &m.round));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "global_rank", 0, kBig, &m.global_rank));
  LAUNCH_RETURN_IF_ERROR(GetString(f, "reason", kMaxShortString, &m.reason));
  return m;
}

Fields ToFields(const ReplaceAnswer& m) {
  return {{"round", std::to_string(m.round)},
          {"global_rank", std::to_string(m.global_rank)},
          {"generation", std::to_string(m.generation)},
          {"restart_count", std::to_string(m.restart_count)},
          {"message", m.message.substr(0, kMaxShortString)}};
}

StatusOr<ReplaceAnswer> ParseReplaceAnswer(const Fields& f) {
  ReplaceAnswer m;
  constexpr long long kBig = 1LL << 30;
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "round", 0, kBig, &m.round));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "global_rank", 0, kBig, &m.global_rank));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "generation", 0, kBig, &m.generation));
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "restart_count", 0, kBig, &m.restart_count));
  LAUNCH_RETURN_IF_ERROR(GetString(f, "message", kMaxShortString, &m.message));
  return m;
}

Fields ToFields(const RestartNotice& m) {
  Fields f{{"next_round", std::to_string(m.next_round)},
           {"counts", m.counts_as_restart ? "1" : "0"},
           {"reason", m.reason.substr(0, kMaxShortString)},
           {"has_report", m.report ? "1" : "0"}};
  if (m.report) PutReport(*m.report, "r_", &f);
  return f;
}

// The root-cause report that restart and failure notices may carry ("has_report" + "r_*").
Status GetOptionalReport(const Fields& f, std::optional<FailureReport>* out) {
  bool has_report = false;
  LAUNCH_RETURN_IF_ERROR(GetBool(f, "has_report", &has_report));
  if (has_report) {
    LAUNCH_ASSIGN_OR_RETURN(FailureReport r, GetReport(f, "r_"));
    *out = std::move(r);
  }
  return Status::Ok();
}

StatusOr<RestartNotice> ParseRestart(const Fields& f) {
  RestartNotice m;
  LAUNCH_RETURN_IF_ERROR(GetInt(f, "next_round", 0, 1 << 30, &m.next_round));
  LAUNCH_RETURN_IF_ERROR(GetBool(f, "counts", &m.counts_as_restart));
  LAUNCH_RETURN_IF_ERROR(GetString(f, "reason", kMaxShortString, &m.reason));
  LAUNCH_RETURN_IF_ERROR(GetOptionalReport(f, &m.report));
  return m;
}

Fields ToFields(const JobFailure& m) {
  Fields f{{"message", m.message.substr(0, kMaxShortString * 4)},
           {"config_error", m.config_error ? "1" : "0"},
           {"has_report", m.report ? "1" : "0"}};
  if (m.report) PutReport(*m.report, "r_", &f);
  return f;
}

StatusOr<JobFailure> ParseJobFailure(const Fields& f) {
  JobFailure m;
  LAUNCH_RETURN_IF_ERROR(GetString(f, "message", kMaxShortString * 4, &m.message));
  LAUNCH_RETURN_IF_ERROR(GetBool(f, "config_error", &m.config_error));
  LAUNCH_RETURN_IF_ERROR(GetOptionalReport(f, &m.report));
  return m;
}

Fields ToFields(const ErrorMessage& m) {
  Fields f = {{"config_error", m.config_error ? "1" : "0"},
              {"auth_error", m.auth_error ? "1" : "0"},
              {"message", m.message.substr(0, kMaxShortString * 4)}};
  if (m.busy) f["busy"] = "1";
  return f;
}

StatusOr<ErrorMessage> ParseError(const Fields& f) {
  ErrorMessage m;
  LAUNCH_RETURN_IF_ERROR(GetBool(f, "config_error", &m.config_error));
  LAUNCH_RETURN_IF_ERROR(GetBool(f, "auth_error", &m.auth_error));
  if (f.count("busy")) LAUNCH_RETURN_IF_ERROR(GetBool(f, "busy", &m.busy));
  LAUNCH_RETURN_IF_ERROR(GetString(f, "message", kMaxShortString * 4, &m.message));
  return m;
}

Status ValidateMessage(MessageType type, const Fields& f) {
  switch (type) {
    case MessageType::kChallenge: {
      std::string nonce;
      LAUNCH_RETURN_IF_ERROR(GetString(f, "nonce", kNonceSize, &nonce));
      return nonce.size() == kNonceSize ? Status::Ok()
                                        : Status::ProtocolError("field 'nonce' has a bad size");
    }
    case MessageType::kHello:
      return ParseHello(f).status();
    case MessageType::kWelcome: {
      std::string proof;
      return GetString(f, "proof", 64, &proof);
    }
    case MessageType::kJoin:
      return ParseJoin(f).status();
    case MessageType::kAssign:
      return ParseAssignment(f).status();
    case MessageType::kReport:
      return ParseFailureReport(f).status();
    case MessageType::kSucceeded: {
      int round = 0;
      return GetInt(f, "round", 0, 1 << 30, &round);
    }
    case MessageType::kRestart:
      return ParseRestart(f).status();
    case MessageType::kFailed:
      return ParseJobFailure(f).status();
    case MessageType::kError:
      return ParseError(f).status();
    case MessageType::kReplace:
      return ParseReplaceRequest(f).status();
    case MessageType::kReplaced:
      return ParseReplaceAnswer(f).status();
    case MessageType::kHeartbeat:
    case MessageType::kDone:
      return Status::Ok();
  }
  return Status::ProtocolError("unknown message type");
}

std::string FormatEndpoint(const std::string& host, int port) {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

std::string FormatFailureReport(const FailureReport& r) {
  std::string what = SanitizeForTerminal(r.reason);
  std::string line = "root cause: ";
  if (r.global_rank >= 0) {
    line += "rank " + std::to_string(r.global_rank) + " (node " + std::to_string(r.node_rank) +
            ", host " + SanitizeForTerminal(r.host) + ", local rank " +
            std::to_string(r.local_rank) + ") ";
    if (what.empty()) {
      what = r.signal > 0 ? "died of " + SignalName(r.signal)
                          : "exited with code " + std::to_string(r.exit_code);
    }
  } else {
    line += "node " + std::to_string(r.node_rank) + " (host " + SanitizeForTerminal(r.host) + ") ";
  }
  line += what + " [round " + std::to_string(r.round) + "]";
  if (!r.stderr_tail.empty()) {
    line += "\n  last stderr lines:";
    for (const std::string& l : Split(SanitizeForTerminal(r.stderr_tail), '\n')) {
      if (!l.empty()) line += "\n  | " + l;
    }
  }
  return line;
}

std::chrono::milliseconds HeartbeatInterval(std::chrono::milliseconds heartbeat_timeout) {
  return std::max(heartbeat_timeout / kHeartbeatsPerTimeout, std::chrono::milliseconds(10));
}

std::chrono::milliseconds LossDeadline(std::chrono::milliseconds heartbeat_timeout) {
  return heartbeat_timeout + heartbeat_timeout / 2;
}

int64_t WallClockMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace launch::rendezvous
