#pragma once

// The rendezvous wire protocol: versioned, length-prefixed frames carrying small typed messages.
//
// Frame (all integers big-endian):
//
//   offset  size  field
//   0       4     magic   "LRDZ"
//   4       2     version kProtocolVersion (a peer speaking another version is refused)
//   6       2     type    MessageType
//   8       4     length  bytes that follow (payload, plus the MAC once authenticated)
//   12      ...   payload a field list (below)
//   ...     32    MAC     after the handshake only: see auth.h and connection.h
//
// Length limits are per message type and direction (MaxPayload below): each type's limit is
// the largest message of that type the parsers below accept, so whatever one side can
// produce, the other accepts, and nothing larger is ever read. Before authentication only the
// handshake messages (CHALLENGE, HELLO, WELCOME, ERROR) are accepted, and at most
// kMaxHandshakePayload bytes of them. kMaxPayloadSize bounds everything (the decoders' own
// limit).
//
// Payload: u16 field count (<= kMaxFields), then per field: u8 key length (1..kMaxKeySize),
// key bytes ([a-z0-9_]), u32 value length, value bytes (any bytes). Keys are strictly
// ascending (one canonical encoding; no duplicates).
//
// A reader checks the 12-byte header (magic, version, known type, the type's length limit)
// BEFORE it allocates anything for the payload, and allocates as bytes arrive, so a peer
// claiming a 4 GiB frame costs nothing, an unauthenticated peer at most kMaxHandshakePayload,
// and an authenticated one (anyone, when no token is set) what its frame's type allows: tens
// of KiB at most towards a server.
// Every decoder below returns a Status on malformed input and never crashes or throws on any
// input (fuzzed by rendezvous/fuzz_protocol.cc).
//
// Message flow (one TCP connection per agent, kept for the whole job):
//
//   server -> agent   CHALLENGE {nonce}
//   agent  -> server  HELLO     {nonce, proof}          proof = HMAC(token, server & agent nonces)
//   server -> agent   WELCOME   {proof}                 the server proves the token back
//   agent  -> server  JOIN      {JoinRequest}           once per round
//   server -> agent   ASSIGN    {Assignment}            the round closed; start workers
//   both ways         HEARTBEAT {}                      every heartbeat_timeout / 5
//   agent  -> server  REPORT    {FailureReport}         a local worker failed
//   agent  -> server  SUCCEEDED {round}                 every local worker exited 0
//   agent  -> server  REPLACE   {ReplaceRequest}        a local worker died: may it be replaced
//                                                       alone (launch --recover in_place)?
//   server -> agent   REPLACED  {ReplaceAnswer}         yes, with this generation; or no: the
//                                                       agent takes its REPORT path
//   server -> agent   RESTART   {RestartNotice}         stop workers, send JOIN again
//   server -> agent   DONE      {}                      every node succeeded: exit 0
//   server -> agent   FAILED    {JobFailure}            the job is over: exit non-zero
//   either way        ERROR     {code, message}         refusal; the sender closes

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "config/limits.h"

namespace launch::rendezvous {

inline constexpr char kMagic[4] = {'L', 'R', 'D', 'Z'};
inline constexpr uint16_t kProtocolVersion = 1;
inline constexpr size_t kHeaderSize = 12;
// Bounds every frame: the largest, an ASSIGN with a node table for kMaxNodes, stays below.
inline constexpr uint32_t kMaxPayloadSize = 64u << 20;  // 64 MiB
inline constexpr uint32_t kMaxHandshakePayload = 4096;
inline constexpr size_t kMaxFields = 256;
inline constexpr size_t kMaxKeySize = 32;

enum class MessageType : uint16_t {
  kChallenge = 1,
  kHello = 2,
  kWelcome = 3,
  kJoin = 4,
  kAssign = 5,
  kHeartbeat = 6,
  kReport = 7,
  kSucceeded = 8,
  kRestart = 9,
  kDone = 10,
  kFailed = 11,
  kError = 12,
  kReplace = 13,
  kReplaced = 14,
};
inline constexpr MessageType kLastMessageType = MessageType::kReplaced;
const char* ToString(MessageType type);

struct FrameHeader {
  MessageType type = MessageType::kError;
  uint32_t length = 0;  // payload bytes
};

// REQUIRES: `data` points at kHeaderSize readable bytes.
// ProtocolError on a wrong magic, an unknown version or type, or length > max_length.
StatusOr<FrameHeader> DecodeHeader(const uint8_t* data, uint32_t max_length = kMaxPayloadSize);
// True for the messages of the handshake (the only ones accepted before authentication).
bool IsHandshakeMessage(MessageType type);

// Which side reads a frame: each accepts only what the other sends.
enum class Receiver { kServer, kAgent };
// One row of an ASSIGN's node table: at most this many bytes (ParseAssignment checks it).
inline constexpr size_t kMaxNodeRowSize = 512;
// The largest payload (fields, without the MAC) a frame of `type` may carry to `receiver`;
// 0 when that side never receives the type. `max_nodes` sizes ASSIGN's node table: the MAX
// node count the receiving agent joined with (a job never assigns more). protocol_test
// builds each message with every field at its largest and checks that it fits.
//
//   to a server: HELLO 256, JOIN 4 KiB, HEARTBEAT 64, REPORT 20 KiB (16 KiB stderr tail),
//                SUCCEEDED 64, REPLACE 2 KiB
//   to an agent: CHALLENGE 256, WELCOME 256, ERROR 4.25 KiB, HEARTBEAT 64, DONE 64,
//                ASSIGN 4 KiB + max_nodes x kMaxNodeRowSize, RESTART 24 KiB, FAILED 28 KiB,
//                REPLACED 2 KiB
uint32_t MaxPayload(MessageType type, Receiver receiver, int max_nodes);

// Field list: keys sorted (std::map), so encoding is deterministic.
using Fields = std::map<std::string, std::string>;

StatusOr<Fields> DecodeFields(std::string_view payload);
// REQUIRES: keys valid (CHECKed: our own messages). The size is not checked here: a sender
// checks it against the limit (Connection::Send) and fails without sending.
std::string EncodeFields(const Fields& fields);
// Header + payload, ready for the socket (`mac_size` extra bytes announced in the length, to
// be appended by the caller).
std::string EncodeFrame(MessageType type, const Fields& fields, size_t mac_size = 0);

// Decodes a whole buffer holding exactly one frame (tests and the fuzzer).
struct Frame {
  MessageType type = MessageType::kError;
  Fields fields;
};
StatusOr<Frame> DecodeFrame(std::string_view bytes);

// ---------------------------------------------------------------------------------------------
// Typed messages. Each has ToFields() and a Parse*() that validates every field (presence,
// range, size) and returns ProtocolError naming the bad field.

struct Hello {
  std::string nonce;  // kNonceSize random bytes
  std::string proof;  // HMAC-SHA256 (32 bytes)
};

// What an agent sends to join a round. The first JOIN fixes the job's spec (run_id,
// min/max nodes, fingerprint); later JOINs must match it.
struct JoinRequest {
  std::string run_id = "default";
  int min_nodes = 1;
  int max_nodes = 1;
  int node_rank = -1;        // requested node rank; -1 = let the server assign one
  int local_world_size = 1;  // workers this node runs
  int master_port = 0;       // a free port this node reserved, used when it becomes rank 0
  std::string hostname;      // for messages only
  std::string fingerprint;   // hash of the settings every node must share (max_restarts...)
  int max_restarts = 0;
  double join_timeout_s = 600;
  double last_call_timeout_s = 1;
  double heartbeat_timeout_s = 10;
  int64_t clock_us = 0;  // the agent's wall clock when it sent the JOIN (0: not sent)
  // launch --recover in_place: a dead worker, or a lost node other than node 0, is replaced
  // alone while the others go on (part of the spec every node must share). Optional on the
  // wire (absent = false).
  bool recover_in_place = false;
};

// Liveness, the same on both sides of a connection, from the job's heartbeat_timeout T:
//  * each side sends a HEARTBEAT every HeartbeatInterval(T) = T / 5;
//  * a peer is lost when nothing at all arrived from it for LossDeadline(T) = 1.5 T (the read
//    deadline: a frozen or hung process), or when data sent to it stayed unacknowledged that
//    long (TCP_USER_TIMEOUT: the network is gone), whichever comes first;
//  * TCP retransmits at least every kRetransmitCap (TCP_RTO_MAX_MS, Linux >= 6.15).
// Why: after an outage a frame gets through only at TCP's next retransmission, and TCP doubles
// the wait each time (0.2, 0.4, 0.8 ... s). Measured on Linux 6.18 (veth pair, blackhole qdisc
// both ways, heartbeats every T / 5): the first frame came up to 0.3 s after a 1.6 s outage
// ended, 3.4 s after a 4 s one and 6.9 s after an 8 s one, so a side saw up to 2.2, 8.0 and
// 15.9 s of silence, and the old deadline of T lost the peer after outages of about T / 2.
// With the cap: at most 1.0 s after (0.2 s typical), silence at most T / 5 + D + 1 s. So with
// 1.5 T an outage of up to 0.8 T costs nothing for any T >= 2 s, and one of 2 T is always a
// lost peer (1.5 T to 1.7 T after it began). (TCP_THIN_LINEAR_TIMEOUTS changed nothing here.)
// Without the cap (older kernels) about 0.6 T is survived.
inline constexpr int kHeartbeatsPerTimeout = 5;
// TCP's longest wait between two retransmissions on a rendezvous connection (TCP_RTO_MAX_MS;
// the kernel's minimum, 1 s; the default is 120 s).
inline constexpr std::chrono::milliseconds kRetransmitCap{1000};
std::chrono::milliseconds HeartbeatInterval(std::chrono::milliseconds heartbeat_timeout);
std::chrono::milliseconds LossDeadline(std::chrono::milliseconds heartbeat_timeout);

// Microseconds since the epoch on this machine's wall clock (FailureReport::time_us).
int64_t WallClockMicros();

struct NodeInfo {
  int node_rank = 0;
  std::string host;     // hostname the agent reported
  std::string address;  // its address as the server saw it
  int local_world_size = 0;
  int rank_offset = 0;
};

// The server's answer when a round closes.
struct Assignment {
  int round = 0;  // 0 for the first round, +1 per restart or scale-up
  // Restarts spent when the round formed (TORCHELASTIC_RESTART_COUNT; a node taking a lost
  // node's place in the running round gets the round's value, like its survivors).
  int restart_count = 0;
  int max_restarts = 0;
  int node_rank = 0;    // this node's rank (GROUP_RANK)
  int num_nodes = 0;    // GROUP_WORLD_SIZE
  int rank_offset = 0;  // global rank of this node's local rank 0
  int local_world_size = 0;
  int world_size = 0;       // sum of local_world_size over nodes
  std::string master_addr;  // node 0's address as the server saw it
  int master_port = 0;      // the port node 0 reserved
  std::string run_id;
  // Non-zero when this node takes a lost node's place in a running round (launch --recover
  // in_place): its workers start with LAUNCH_RECOVER_GENERATION = generation and join the
  // survivors' recovery. Optional on the wire (absent = 0).
  int generation = 0;
  // With a generation: how long before this ASSIGN the server noticed the loss of the node whose
  // place this one takes, in ms (its workers' recovery times count from then). A duration, not
  // a time: the server's clock and this node's need not agree. Optional (absent = 0).
  int lost_ms_ago = 0;
  // By node rank (encoded as one field, one line of at most kMaxNodeRowSize bytes per node).
  // The server sends it empty: each node gets only its own row above, since a table in every
  // node's ASSIGN is O(n^2) bytes per round.
  std::vector<NodeInfo> nodes;
};

// A worker failure (or a lost node), as the first node that saw it describes it.
struct FailureReport {
  int round = 0;
  std::string host;  // hostname of the failing node
  int node_rank = -1;
  int global_rank = -1;  // -1 when the whole node was lost
  int local_rank = -1;
  int exit_code = -1;       // -1 when killed by a signal
  int signal = 0;           // 0 when it exited
  std::string reason;       // one line: "exited with code 3", "node lost: connection closed"
  std::string stderr_tail;  // last lines of the worker's stderr, '\n'-separated (<= 16 KiB)
  // When the failure happened, in microseconds of the reporting node's wall clock since the
  // epoch (0: unknown). The server corrects it by the node's clock offset measured at JOIN and
  // takes the earliest failure of a round as its root cause.
  int64_t time_us = 0;
};

// An agent asks whether the worker of `global_rank`, which died, may be replaced alone
// (launch --recover in_place).
struct ReplaceRequest {
  int round = 0;
  int global_rank = 0;
  std::string reason;  // one line: "killed by SIGKILL"
};

// The server's answer to a REPLACE.
struct ReplaceAnswer {
  int round = 0;
  int global_rank = 0;
  // > 0: granted; the replacement's LAUNCH_RECOVER_GENERATION, unique and increasing over the
  // whole job. 0: refused (`message` says why); the agent reports the failure as usual.
  int generation = 0;
  int restart_count = 0;  // restarts spent so far, this one included when granted
  std::string message;    // one line: why it was refused
};

struct RestartNotice {
  int next_round = 0;
  bool counts_as_restart = true;        // false for scale-up
  std::string reason;                   // one line
  std::optional<FailureReport> report;  // the first failure, when a failure caused it
};

struct JobFailure {
  std::string message;                  // one line, "why the job is over"
  bool config_error = false;            // true: a fail-fast setup error (exit 2)
  std::optional<FailureReport> report;  // root cause when a worker failure ended the job
};

struct ErrorMessage {
  bool config_error = false;  // exit 2 on the receiving side
  bool auth_error = false;
  // The server has no room for this connection now (too many from its address in the
  // handshake, or too many connections): try again, until join_timeout. Optional on the wire
  // (absent = 0), so an older peer still parses the message.
  bool busy = false;
  std::string message;
};

inline constexpr size_t kNonceSize = 32;
inline constexpr size_t kMaxStderrTail = 16 * 1024;
inline constexpr size_t kMaxShortString = 1024;
inline constexpr int kMaxNodes = config::kMaxNodes;

Fields ToFields(const Hello& m);
Fields ToFields(const JoinRequest& m);
Fields ToFields(const Assignment& m);
Fields ToFields(const FailureReport& m);
Fields ToFields(const ReplaceRequest& m);
Fields ToFields(const ReplaceAnswer& m);
Fields ToFields(const RestartNotice& m);
Fields ToFields(const JobFailure& m);
Fields ToFields(const ErrorMessage& m);

StatusOr<Hello> ParseHello(const Fields& f);
StatusOr<JoinRequest> ParseJoin(const Fields& f);
StatusOr<Assignment> ParseAssignment(const Fields& f);
StatusOr<FailureReport> ParseFailureReport(const Fields& f);
StatusOr<ReplaceRequest> ParseReplaceRequest(const Fields& f);
StatusOr<ReplaceAnswer> ParseReplaceAnswer(const Fields& f);
StatusOr<RestartNotice> ParseRestart(const Fields& f);
StatusOr<JobFailure> ParseJobFailure(const Fields& f);
StatusOr<ErrorMessage> ParseError(const Fields& f);

// Parses the payload of a frame of any type with its typed parser (fuzzer entry point).
Status ValidateMessage(MessageType type, const Fields& fields);

// "host:port", or "[v6]:port" for IPv6 literals.
std::string FormatEndpoint(const std::string& host, int port);

// A multi-line report for the console, identical on every node:
//   "root cause: rank 3 (node 1, host gpu02, local rank 1) exited with code 7\n  | last stderr..."
// Control characters from the peer are replaced (SanitizeForTerminal, base/strings.h), so a
// report cannot drive the terminal.
std::string FormatFailureReport(const FailureReport& r);

}  // namespace launch::rendezvous
