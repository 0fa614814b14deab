#include "rendezvous/protocol.h"

#include <set>

#include <doctest/doctest.h>

#include "base/strings.h"

namespace launch::rendezvous {
namespace {

std::string Header(uint16_t version, uint16_t type, uint32_t length) {
  std::string h(kMagic, 4);
  h.push_back(static_cast<char>(version >> 8));
  h.push_back(static_cast<char>(version & 0xff));
  h.push_back(static_cast<char>(type >> 8));
  h.push_back(static_cast<char>(type & 0xff));
  for (int s = 24; s >= 0; s -= 8) h.push_back(static_cast<char>((length >> s) & 0xff));
  return h;
}

TEST_CASE("FrameRoundTripsFields") {
  Fields f{{"a", "1"}, {"bin", std::string("\0\xff\n", 3)}, {"empty", ""}};
  std::string frame = EncodeFrame(MessageType::kJoin, f);
  CHECK(frame.size() > kHeaderSize);
  StatusOr<Frame> decoded = DecodeFrame(frame);
  REQUIRE(decoded.ok());
  CHECK(decoded->type == MessageType::kJoin);
  CHECK(decoded->fields == f);
}

TEST_CASE("HeaderRejectsBadMagicVersionTypeAndHugeLength") {
  std::string good = Header(kProtocolVersion, 6, 2);
  CHECK(DecodeHeader(reinterpret_cast<const uint8_t*>(good.data())).ok());
  std::string magic = good;
  magic[0] = 'X';
  CHECK(DecodeHeader(reinterpret_cast<const uint8_t*>(magic.data())).status().code() ==
        Status::Code::kProtocolError);
  std::string version = Header(2, 6, 2);
  Status v = DecodeHeader(reinterpret_cast<const uint8_t*>(version.data())).status();
  CHECK(v.message().find("version 2") != std::string::npos);
  std::string type = Header(kProtocolVersion, 99, 2);
  CHECK_FALSE(DecodeHeader(reinterpret_cast<const uint8_t*>(type.data())).ok());
  std::string huge = Header(kProtocolVersion, 6, 0xffffffffu);
  Status h = DecodeHeader(reinterpret_cast<const uint8_t*>(huge.data())).status();
  CHECK(h.message().find("exceeds the limit") != std::string::npos);
  std::string limit = Header(kProtocolVersion, 6, kMaxPayloadSize);
  CHECK(DecodeHeader(reinterpret_cast<const uint8_t*>(limit.data())).ok());
}

TEST_CASE("FieldDecoderRejectsMalformedPayloads") {
  CHECK_FALSE(DecodeFields("").ok());
  CHECK_FALSE(DecodeFields(std::string("\x00\x01", 2)).ok());  // one field promised, none there
  // key length 0
  CHECK_FALSE(DecodeFields(std::string("\x00\x01\x00", 3)).ok());
  // value runs past the end
  CHECK_FALSE(DecodeFields(std::string("\x00\x01\x01k\x00\x00\x00\x09xy", 10)).ok());
  // uppercase key
  CHECK_FALSE(DecodeFields(std::string("\x00\x01\x01K\x00\x00\x00\x00", 8)).ok());
  // duplicate key
  CHECK_FALSE(
      DecodeFields(std::string("\x00\x02\x01k\x00\x00\x00\x00\x01k\x00\x00\x00\x00", 14)).ok());
  // trailing garbage
  CHECK_FALSE(DecodeFields(std::string("\x00\x00z", 3)).ok());
  CHECK(DecodeFields(std::string("\x00\x00", 2)).ok());
}

TEST_CASE("JoinRoundTripsAndRejectsOutOfRangeFields") {
  JoinRequest j;
  j.run_id = "job7";
  j.min_nodes = 2;
  j.max_nodes = 4;
  j.node_rank = 3;
  j.local_world_size = 8;
  j.master_port = 29555;
  j.hostname = "gpu01";
  j.fingerprint = "abc";
  j.max_restarts = 3;
  j.join_timeout_s = 12.5;
  StatusOr<JoinRequest> back = ParseJoin(ToFields(j));
  REQUIRE(back.ok());
  CHECK(back->run_id == "job7");
  CHECK(back->min_nodes == 2);
  CHECK(back->max_nodes == 4);
  CHECK(back->node_rank == 3);
  CHECK(back->local_world_size == 8);
  CHECK(back->master_port == 29555);
  CHECK(back->join_timeout_s == doctest::Approx(12.5));

  Fields f = ToFields(j);
  f["max_nodes"] = "1";
  CHECK(ParseJoin(f).status().message() == "max_nodes is below min_nodes");
  f = ToFields(j);
  f["master_port"] = "70000";
  CHECK(ParseJoin(f).status().message().find("master_port") != std::string::npos);
  f = ToFields(j);
  f.erase("run_id");
  CHECK(ParseJoin(f).status().message() == "missing field 'run_id'");
  f = ToFields(j);
  f["heartbeat_timeout"] = "nan";
  CHECK_FALSE(ParseJoin(f).ok());
}

TEST_CASE("AssignmentRoundTripsWithNodeTable") {
  Assignment a;
  a.round = 2;
  a.restart_count = 1;
  a.max_restarts = 3;
  a.node_rank = 1;
  a.num_nodes = 2;
  a.rank_offset = 2;
  a.local_world_size = 3;
  a.world_size = 5;
  a.master_addr = "10.0.0.1";
  a.master_port = 29600;
  a.run_id = "r";
  a.nodes = {{0, "h0", "10.0.0.1", 2, 0}, {1, "h1", "10.0.0.2", 3, 2}};
  StatusOr<Assignment> back = ParseAssignment(ToFields(a));
  REQUIRE(back.ok());
  CHECK(back->rank_offset == 2);
  CHECK(back->world_size == 5);
  REQUIRE(back->nodes.size() == 2);
  CHECK(back->nodes[1].host == "h1");
  CHECK(back->nodes[1].rank_offset == 2);
  Fields f = ToFields(a);
  f["rank_offset"] = "4";  // would put local ranks past world_size
  CHECK_FALSE(ParseAssignment(f).ok());
  // What reaches the workers' environment is checked: an address, printable text.
  f = ToFields(a);
  f["master_addr"] = "$(reboot)";
  CHECK(ParseAssignment(f).status().message() == "field 'master_addr' is not an IP address");
  f = ToFields(a);
  f["master_addr"] = "fe80::1";
  CHECK(ParseAssignment(f).ok());
  f = ToFields(a);
  f["run_id"] = "a\nLD_PRELOAD=x";
  CHECK_FALSE(ParseAssignment(f).ok());
}

TEST_CASE("RestartAndFailureCarryTheRootCause") {
  FailureReport r;
  r.round = 1;
  r.host = "gpu02";
  r.node_rank = 1;
  r.global_rank = 3;
  r.local_rank = 1;
  r.signal = 9;
  r.stderr_tail = "line1\nline2\x1b[31m";
  RestartNotice n;
  n.next_round = 2;
  n.reason = "worker failure";
  n.report = r;
  StatusOr<RestartNotice> back = ParseRestart(ToFields(n));
  REQUIRE(back.ok());
  REQUIRE(back->report.has_value());
  CHECK(back->report->signal == 9);
  std::string text = FormatFailureReport(*back->report);
  CHECK(text.find("rank 3 (node 1, host gpu02, local rank 1) died of SIGKILL") !=
        std::string::npos);
  CHECK(text.find("| line2?[31m") != std::string::npos);  // escape neutralised
  JobFailure jf;
  jf.message = "job failed";
  StatusOr<JobFailure> jb = ParseJobFailure(ToFields(jf));
  REQUIRE(jb.ok());
  CHECK_FALSE(jb->report.has_value());
}

TEST_CASE("ErrorBusyFlagIsOptionalOnTheWire") {
  ErrorMessage busy;
  busy.busy = true;
  busy.message = "the rendezvous server is busy";
  StatusOr<ErrorMessage> back = ParseError(ToFields(busy));
  REQUIRE(back.ok());
  CHECK(back->busy);
  ErrorMessage plain;
  plain.config_error = true;
  Fields f = ToFields(plain);
  CHECK(f.count("busy") == 0);  // what an older peer sends and expects
  back = ParseError(f);
  REQUIRE(back.ok());
  CHECK_FALSE(back->busy);
  f["busy"] = "yes";
  CHECK_FALSE(ParseError(f).ok());
}

// The largest message of a type that its parser accepts: every integer written with the 24
// characters GetInt reads (leading zeros), every duration with 32.
Fields Widest(Fields f) {
  const std::set<std::string> flags = {"counts",     "has_report", "config_error",
                                       "auth_error", "busy",       "recover_in_place"};
  for (auto& [key, value] : f) {
    long long v = 0;
    if (!flags.count(key) && !value.empty() && ParseInt64(value, &v) &&
        value.find_first_not_of("0123456789") == std::string::npos)
      value = std::string(24 - value.size(), '0') + value;
  }
  for (const char* key : {"join_timeout", "last_call_timeout", "heartbeat_timeout"})
    if (f.count(key)) f[key] = "0000000000000000000000000000005";
  return f;
}

FailureReport LargestReport() {
  FailureReport r;
  r.host = std::string(kMaxShortString, 'h');
  r.reason = std::string(kMaxShortString, 'r');
  r.stderr_tail = std::string(kMaxStderrTail, 'e');
  r.global_rank = r.local_rank = r.node_rank = r.exit_code = 1;
  r.time_us = 1;
  return r;
}

TEST_CASE("EveryMessageAtItsLargestFitsItsTypesLimitAndNoMore") {
  auto fits = [](MessageType type, Receiver to, const Fields& f, int max_nodes = kMaxNodes) {
    INFO(std::string(ToString(type)));
    Status valid = ValidateMessage(type, f);  // still a message the parser accepts
    INFO(valid.ToString());
    REQUIRE(valid.ok());
    const size_t size = EncodeFields(f).size();
    const uint32_t limit = MaxPayload(type, to, max_nodes);
    CHECK(size <= limit);
    return size;
  };
  JoinRequest j;
  j.run_id = std::string(1024, 'r');
  j.hostname = std::string(256, 'h');
  j.fingerprint = std::string(256, 'f');
  j.master_port = 1;
  fits(MessageType::kJoin, Receiver::kServer, Widest(ToFields(j)));
  fits(MessageType::kReport, Receiver::kServer, Widest(ToFields(LargestReport())));
  fits(MessageType::kSucceeded, Receiver::kServer, Widest({{"round", "1"}}));
  fits(MessageType::kHeartbeat, Receiver::kServer, {});
  ReplaceRequest replace;
  replace.reason = std::string(kMaxShortString, 'r');
  fits(MessageType::kReplace, Receiver::kServer, Widest(ToFields(replace)));
  ReplaceAnswer replaced;
  replaced.generation = 1;
  replaced.message = std::string(kMaxShortString, 'm');
  fits(MessageType::kReplaced, Receiver::kAgent, Widest(ToFields(replaced)));
  Hello hello{std::string(kNonceSize, 'n'), std::string(64, 'p')};
  fits(MessageType::kHello, Receiver::kServer, ToFields(hello));
  fits(MessageType::kChallenge, Receiver::kAgent, {{"nonce", std::string(kNonceSize, 'n')}});
  fits(MessageType::kWelcome, Receiver::kAgent, {{"proof", std::string(64, 'p')}});
  ErrorMessage err;
  err.busy = true;
  err.message = std::string(kMaxShortString * 4, 'm');
  fits(MessageType::kError, Receiver::kAgent, ToFields(err));
  RestartNotice restart;
  restart.reason = std::string(kMaxShortString, 'r');
  restart.report = LargestReport();
  fits(MessageType::kRestart, Receiver::kAgent, Widest(ToFields(restart)));
  JobFailure failed;
  failed.message = std::string(kMaxShortString * 4, 'm');
  failed.report = LargestReport();
  fits(MessageType::kFailed, Receiver::kAgent, Widest(ToFields(failed)));
  // ASSIGN with a full node table for 20 nodes, each row at its largest: within the limit of
  // an agent of a 20-node job, beyond that of a 2-node job's.
  Assignment a;
  a.num_nodes = 20;
  a.world_size = 20;
  a.local_world_size = 1;
  a.master_addr = "10.0.0.1";
  a.master_port = 1;
  a.run_id = std::string(kMaxShortString, 'r');
  a.generation = 1;
  for (int r = 0; r < a.num_nodes; ++r) {
    // "r\thost\taddress\t1\tr\n", kMaxNodeRowSize bytes in all.
    const std::string rank = std::to_string(r);
    NodeInfo n{r, std::string(256, 'h'), "", 1, r};
    n.address = std::string(kMaxNodeRowSize - 2 * rank.size() - 256 - 1 - 5, 'a');
    a.nodes.push_back(n);
  }
  const size_t assign = fits(MessageType::kAssign, Receiver::kAgent, Widest(ToFields(a)), 20);
  CHECK(assign > MaxPayload(MessageType::kAssign, Receiver::kAgent, 2));  // the table counts
  CHECK(MaxPayload(MessageType::kAssign, Receiver::kAgent, kMaxNodes) <= kMaxPayloadSize);
  // A row longer than that is refused.
  a.nodes[0].host += "x";
  CHECK_FALSE(ParseAssignment(ToFields(a)).ok());
  // Tens of KiB at most towards a server; nothing it never receives.
  for (uint16_t t = 1; t <= static_cast<uint16_t>(kLastMessageType); ++t) {
    const auto type = static_cast<MessageType>(t);
    CHECK(MaxPayload(type, Receiver::kServer, kMaxNodes) <= 32u * 1024);
    const bool agent_sends = type == MessageType::kHello || type == MessageType::kJoin ||
                             type == MessageType::kHeartbeat || type == MessageType::kReport ||
                             type == MessageType::kSucceeded || type == MessageType::kReplace;
    CHECK((MaxPayload(type, Receiver::kServer, kMaxNodes) > 0) == agent_sends);
  }
}

TEST_CASE("ReplaceMessagesRoundTripAndRecoverFieldsAreOptional") {
  ReplaceRequest q{3, 17, "killed by SIGKILL"};
  StatusOr<ReplaceRequest> q2 = ParseReplaceRequest(ToFields(q));
  REQUIRE(q2.ok());
  CHECK(q2->round == 3);
  CHECK(q2->global_rank == 17);
  CHECK(q2->reason == "killed by SIGKILL");
  ReplaceAnswer a{3, 17, 5, 2, ""};
  StatusOr<ReplaceAnswer> a2 = ParseReplaceAnswer(ToFields(a));
  REQUIRE(a2.ok());
  CHECK(a2->generation == 5);
  CHECK(a2->restart_count == 2);
  Fields bad = ToFields(a);
  bad["generation"] = "-1";
  CHECK_FALSE(ParseReplaceAnswer(bad).ok());
  // An older agent's JOIN and an older server's ASSIGN parse, without recovery.
  JoinRequest j;
  j.master_port = 1;
  j.recover_in_place = true;
  Fields jf = ToFields(j);
  REQUIRE(ParseJoin(jf).ok());
  CHECK(ParseJoin(jf)->recover_in_place);
  jf.erase("recover_in_place");
  REQUIRE(ParseJoin(jf).ok());
  CHECK_FALSE(ParseJoin(jf)->recover_in_place);
  Assignment as;
  as.num_nodes = as.world_size = as.local_world_size = 1;
  as.master_addr = "10.0.0.1";
  as.master_port = 1;
  CHECK(ToFields(as).count("generation") == 0);
  as.generation = 4;
  REQUIRE(ParseAssignment(ToFields(as)).ok());
  CHECK(ParseAssignment(ToFields(as))->generation == 4);
  CHECK(ToFields(as).count("lost_ms_ago") == 0);
  as.lost_ms_ago = 1250;
  CHECK(ParseAssignment(ToFields(as))->lost_ms_ago == 1250);
  // The new types pass the header check; the next number does not.
  std::string frame = EncodeFrame(MessageType::kReplaced, ToFields(a));
  REQUIRE(DecodeFrame(frame).ok());
  frame[7] = static_cast<char>(static_cast<uint16_t>(kLastMessageType) + 1);
  CHECK_FALSE(DecodeFrame(frame).ok());
}

TEST_CASE("FormatEndpointBracketsIpv6") {
  CHECK(FormatEndpoint("10.0.0.1", 29500) == "10.0.0.1:29500");
  CHECK(FormatEndpoint("::1", 29500) == "[::1]:29500");
}

}  // namespace
}  // namespace launch::rendezvous
