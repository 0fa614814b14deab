#include "rendezvous/etcd_client.h"

#include <openssl/evp.h>

#include <cctype>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "base/strings.h"
#include "rendezvous/connection.h"

namespace launch::rendezvous {

namespace http = boost::beast::http;
using nlohmann::json;

struct EtcdClient::Reply {
  json body;
};

namespace {

// A range query covers [key, range_end) (etcd's convention): the prefix's successor is
// the prefix with its last byte below 0xff incremented and everything after it dropped. A
// prefix of 0xff bytes only (or empty) has none: "\0" as range_end means "to the end".
std::string PrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty() && static_cast<unsigned char>(end.back()) == 0xff) end.pop_back();
  if (end.empty()) return std::string(1, '\0');
  end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
  return end;
}

std::string EncodeBase64(const std::string& bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3) + 1, '\0');
  int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(bytes.data()),
                          static_cast<int>(bytes.size()));
  out.resize(n);
  return out;
}

// EVP_DecodeBlock decodes whole 4-character groups and counts a padding '=' as a zero byte:
// those bytes are dropped here.
std::optional<std::string> DecodeBase64(const std::string& text) {
  if (text.size() % 4 != 0) return std::nullopt;
  std::string out(text.size() / 4 * 3, '\0');
  int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(text.data()),
                          static_cast<int>(text.size()));
  if (n < 0) return std::nullopt;
  size_t padding = 0;
  while (padding < 2 && padding < text.size() && text[text.size() - 1 - padding] == '=') ++padding;
  out.resize(n - padding);
  return out;
}

// The gateway writes 64-bit numbers as strings ("2324035692501542149") and leaves out fields
// equal to zero (or empty): a missing field is 0. Returns false for anything else.
bool EtcdInt(const json& object, const char* name, int64_t* out) {
  *out = 0;
  auto it = object.find(name);
  if (it == object.end()) return true;
  long long v = 0;
  if (it->is_number_integer())
    v = it->get<long long>();
  else if (!it->is_string() || !ParseInt64(it->get<std::string>(), &v))
    return false;
  *out = v;
  return true;
}

// The same for a base64 field: a missing one is "".
bool EtcdBytes(const json& object, const char* name, std::string* out) {
  out->clear();
  auto it = object.find(name);
  if (it == object.end()) return true;
  if (!it->is_string()) return false;
  std::optional<std::string> bytes = DecodeBase64(it->get<std::string>());
  if (!bytes) return false;
  *out = std::move(*bytes);
  return true;
}

Status Malformed(const std::string& what) {
  return Status::ProtocolError("etcd answered with a malformed " + what);
}

StatusOr<EtcdKeyValue> ParseKeyValue(const json& kv) {
  EtcdKeyValue out;
  if (!EtcdBytes(kv, "key", &out.key) || !EtcdBytes(kv, "value", &out.value) ||
      !EtcdInt(kv, "create_revision", &out.create_revision) ||
      !EtcdInt(kv, "mod_revision", &out.mod_revision) || !EtcdInt(kv, "lease", &out.lease))
    return Malformed("key-value " + kv.dump());
  return out;
}

// The "kvs" of a range answer.
StatusOr<std::vector<EtcdKeyValue>> ParseKvs(const json& range) {
  std::vector<EtcdKeyValue> out;
  auto it = range.find("kvs");
  if (it == range.end()) return out;
  if (!it->is_array()) return Malformed("range answer");
  for (const json& kv : *it) {
    if (!kv.is_object()) return Malformed("range answer");
    LAUNCH_ASSIGN_OR_RETURN(EtcdKeyValue parsed, ParseKeyValue(kv));
    out.push_back(std::move(parsed));
  }
  return out;
}

std::string Duration(std::chrono::milliseconds d) {
  return d.count() % 1000 == 0 ? std::to_string(d.count() / 1000) + " s"
                               : std::to_string(d.count()) + " ms";
}

std::string Lowercased(std::string text) {
  if (!text.empty()) text[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(text[0])));
  return text;
}

// One HTTP exchange with one endpoint.
struct Exchange {
  bool answered = false;
  unsigned http_status = 0;
  std::string body;
  std::string local_address;  // ours, on that connection
  std::string error;          // why there is no answer
};

// POSTs `body` to `target` on `host`:`port`, all of it (resolving, connecting, writing, reading)
// bounded by `timeout`: a private io_context runs for at most that long, and destroying it
// abandons whatever is still pending (a member without quorum never answers).
Exchange Post(const std::string& host, const std::string& port, const std::string& host_header,
              const std::string& target, const std::string& body,
              std::chrono::milliseconds timeout) {
  Exchange result;
  http::request<http::string_body> request{http::verb::post, target, 11};
  request.set(http::field::host, host_header);
  request.set(http::field::content_type, "application/json");
  request.keep_alive(false);
  request.body() = body;
  request.prepare_payload();
  boost::beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(64 << 20);  // a GetPrefix of a large job's keys; well above what we store
  // Declared after what its handlers use, so it is destroyed (with those handlers) first.
  asio::io_context io;
  tcp::socket socket(io);
  tcp::resolver resolver(io);
  bool connected = false, finished = false;
  auto fail = [&](const std::string& what, const boost::system::error_code& ec) {
    result.error = what + Lowercased(ec.message());
    finished = true;
  };
  auto on_connect = [&](const boost::system::error_code& ec, const tcp::endpoint&) {
    if (ec) return fail("", ec);
    connected = true;
    boost::system::error_code ignored;
    auto local = socket.local_endpoint(ignored);
    if (!ignored) result.local_address = AddressString(local.address());
    http::async_write(socket, request, [&](const boost::system::error_code& ec, size_t) {
      if (ec) return fail("sending the request: ", ec);
      http::async_read(socket, buffer, parser, [&](const boost::system::error_code& ec, size_t) {
        if (ec) return fail("reading the answer: ", ec);
        result.answered = finished = true;
        result.http_status = parser.get().result_int();
        result.body = std::move(parser.get().body());
      });
    });
  };
  // An address needs no resolver (whose thread the io_context would have to join).
  boost::system::error_code ec;
  asio::ip::address address = asio::ip::make_address(host, ec);
  if (!ec) {
    asio::async_connect(socket, std::vector<tcp::endpoint>{{address, uint16_t(std::stoi(port))}},
                        on_connect);
  } else {
    resolver.async_resolve(
        host, port, [&](const boost::system::error_code& ec, tcp::resolver::results_type results) {
          if (ec) return fail("cannot resolve " + host + ": ", ec);
          asio::async_connect(socket, results, on_connect);
        });
  }
  io.run_for(timeout);
  if (!finished) {
    result.error = connected ? "no answer within " + Duration(timeout) +
                                   " (a cluster without quorum holds requests)"
                             : "no connection within " + Duration(timeout);
  }
  return result;
}

}  // namespace

StatusOr<EtcdClient> EtcdClient::Create(EtcdOptions options) {
  if (options.endpoints.empty()) return Status::InvalidConfig("no etcd endpoints given");
  if (options.request_timeout.count() <= 0)
    return Status::InvalidConfig("etcd request timeout must be positive");
  std::vector<Endpoint> endpoints;
  for (const std::string& given : options.endpoints) {
    auto bad = [&](const std::string& why) {
      return Status::InvalidConfig("etcd endpoint '" + given + "': " + why);
    };
    std::string rest = given;
    if (StartsWith(rest, "https://")) return bad("TLS is not supported (use http://)");
    if (StartsWith(rest, "http://")) rest = rest.substr(7);
    if (EndsWith(rest, "/")) rest.pop_back();
    Endpoint e;
    size_t colon;
    if (StartsWith(rest, "[")) {
      size_t close = rest.find(']');
      if (close == std::string::npos) return bad("no ']' after the IPv6 address");
      e.host = rest.substr(1, close - 1);
      colon = close + 1;
      if (colon >= rest.size() || rest[colon] != ':') return bad("expected host:port");
    } else {
      colon = rest.rfind(':');
      if (colon == std::string::npos) return bad("expected host:port");
      e.host = rest.substr(0, colon);
      if (e.host.find(':') != std::string::npos)
        return bad("write an IPv6 address in brackets: [addr]:port");
    }
    e.port = rest.substr(colon + 1);
    long long port = 0;
    if (!ParseInt64(e.port, &port) || port < 1 || port > 65535)
      return bad("'" + e.port + "' is not a port number");
    if (e.host.empty()) return bad("no host");
    e.text = (StartsWith(rest, "[") ? "[" + e.host + "]" : e.host) + ":" + e.port;
    endpoints.push_back(std::move(e));
  }
  return EtcdClient(std::move(options), std::move(endpoints));
}

EtcdClient::EtcdClient(EtcdOptions options, std::vector<Endpoint> endpoints)
    : options_(std::move(options)), endpoints_(std::move(endpoints)) {}

std::string EtcdClient::Describe() const {
  std::vector<std::string> texts;
  for (const Endpoint& e : endpoints_) texts.push_back(e.text);
  return Join(texts, ", ");
}

StatusOr<EtcdClient::Reply> EtcdClient::Call(const char* path, const std::string& request) {
  std::vector<std::string> failures;
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    size_t index = (preferred_ + i) % endpoints_.size();
    const Endpoint& e = endpoints_[index];
    Exchange x = Post(e.host, e.port, e.text, path, request, options_.request_timeout);
    if (x.answered) {
      // Errors come as {"error": text, "code": gRPC code} (etcd 3.4), {"code": gRPC code,
      // "message": text} (3.5), or for a streaming call such as keepalive {"error": {"message":
      // text, "grpc_code": code}}, often with a non-200 status.
      json body = json::parse(x.body, nullptr, /*allow_exceptions=*/false);
      auto error = body.is_object() ? body.find("error") : body.end();
      if (body.is_object() && error == body.end()) {
        int64_t code = 0;
        if (EtcdInt(body, "code", &code) && code != 0) error = body.find("message");
      }
      if (!body.is_object()) {
        x.error = "answered HTTP " + std::to_string(x.http_status) +
                  " without JSON (not etcd's v3 JSON gateway?)";
      } else if (error != body.end()) {
        std::string message = error->dump();
        int64_t code = 0;
        if (error->is_string()) {
          message = error->get<std::string>();
          EtcdInt(body, "code", &code);
        } else if (error->is_object()) {
          auto text = error->find("message");
          if (text != error->end() && text->is_string()) message = text->get<std::string>();
          EtcdInt(*error, "grpc_code", &code);
        }
        // gRPC's Unavailable: this member cannot serve now (no leader, timed out); another may.
        if (code != 14) {
          preferred_ = index;
          local_address_ = x.local_address;
          std::string text = "etcd at " + e.text + ": " + SanitizeForTerminal(message);
          if (code == 5) return Status::NotFound(text);         // a lease that is gone
          if (code == 3) return Status::InvalidArgument(text);  // a request etcd rejects
          // The store refused a well-formed request (full, overloaded): like a failed write.
          return Status::IoError(text);
        }
        x.error = SanitizeForTerminal(message);
      } else if (x.http_status != 200) {
        x.error = "answered HTTP " + std::to_string(x.http_status);
      } else {
        preferred_ = index;
        local_address_ = x.local_address;
        return Reply{std::move(body)};
      }
    }
    failures.push_back(e.text + ": " + x.error);
  }
  // PeerLost, not Timeout or IoError: the store is the job's coordinator, and losing all of it
  // is to the caller what losing the rendezvous server is (base/status.h: "a remote ... went
  // away"); Timeout means a setup deadline passed.
  return Status::PeerLost("etcd at " + Join(failures, "; "));
}

StatusOr<int64_t> EtcdClient::Grant(int ttl_s) {
  if (ttl_s <= 0) return Status::InvalidArgument("etcd lease TTL must be positive");
  LAUNCH_ASSIGN_OR_RETURN(Reply r, Call("/v3/lease/grant", json{{"TTL", ttl_s}}.dump()));
  int64_t id = 0;
  if (!EtcdInt(r.body, "ID", &id) || id == 0) return Malformed("lease grant: " + r.body.dump());
  return id;
}

StatusOr<int64_t> EtcdClient::KeepAlive(int64_t lease) {
  json request = {{"ID", std::to_string(lease)}};
  LAUNCH_ASSIGN_OR_RETURN(Reply r, Call("/v3/lease/keepalive", request.dump()));
  // A stream's messages come wrapped: {"result": {..., "TTL": "3"}}; no TTL = the lease is gone.
  auto result = r.body.find("result");
  int64_t ttl = 0;
  if (result == r.body.end() || !result->is_object() || !EtcdInt(*result, "TTL", &ttl))
    return Malformed("lease keepalive: " + r.body.dump());
  return ttl;
}

Status EtcdClient::Revoke(int64_t lease) {
  StatusOr<Reply> r = Call("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump());
  if (!r.ok() && r.status().code() == Status::Code::kNotFound) return Status::Ok();
  return r.status();
}

StatusOr<std::optional<EtcdKeyValue>> EtcdClient::Get(const std::string& key) {
  LAUNCH_ASSIGN_OR_RETURN(Reply r, Call("/v3/kv/range", json{{"key", EncodeBase64(key)}}.dump()));
  LAUNCH_ASSIGN_OR_RETURN(std::vector<EtcdKeyValue> kvs, ParseKvs(r.body));
  if (kvs.empty()) return std::optional<EtcdKeyValue>();
  return std::optional<EtcdKeyValue>(std::move(kvs[0]));
}

StatusOr<std::vector<EtcdKeyValue>> EtcdClient::GetPrefix(const std::string& prefix) {
  // An empty prefix is every key: [ "\0", "\0" ) in etcd's convention.
  json request = {{"key", EncodeBase64(prefix.empty() ? std::string(1, '\0') : prefix)},
                  {"range_end", EncodeBase64(PrefixEnd(prefix))}};
  LAUNCH_ASSIGN_OR_RETURN(Reply r, Call("/v3/kv/range", request.dump()));
  return ParseKvs(r.body);
}

Status EtcdClient::Put(const std::string& key, const std::string& value, int64_t lease) {
  json request = {{"key", EncodeBase64(key)}, {"value", EncodeBase64(value)}};
  if (lease != 0) request["lease"] = std::to_string(lease);
  return Call("/v3/kv/put", request.dump()).status();
}

StatusOr<std::pair<bool, EtcdKeyValue>> EtcdClient::CreateIfAbsent(const std::string& key,
                                                                   const std::string& value,
                                                                   int64_t lease) {
  // One transaction: if the key was never created (create_revision 0), put it; either way, read
  // it back, so the answer's last response holds the key as it is now.
  json compare = {{"key", EncodeBase64(key)},
                  {"target", "CREATE"},
                  {"result", "EQUAL"},
                  {"create_revision", "0"}};
  json put = {{"key", EncodeBase64(key)}, {"value", EncodeBase64(value)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  json range = {{"request_range", {{"key", EncodeBase64(key)}}}};
  json request = json::object();
  request["compare"] = json::array({compare});
  request["success"] = json::array({json{{"request_put", put}}, range});
  request["failure"] = json::array({range});
  LAUNCH_ASSIGN_OR_RETURN(Reply r, Call("/v3/kv/txn", request.dump()));
  auto succeeded = r.body.find("succeeded");  // left out when false
  bool created = succeeded != r.body.end() && succeeded->is_boolean() && succeeded->get<bool>();
  auto responses = r.body.find("responses");
  if (responses == r.body.end() || !responses->is_array() || responses->empty() ||
      !responses->back().is_object() || !responses->back().contains("response_range") ||
      !responses->back().at("response_range").is_object())
    return Malformed("transaction answer: " + r.body.dump());
  LAUNCH_ASSIGN_OR_RETURN(std::vector<EtcdKeyValue> kvs,
                          ParseKvs(responses->back().at("response_range")));
  if (kvs.empty()) return Malformed("transaction answer (no key): " + r.body.dump());
  return std::make_pair(created, std::move(kvs[0]));
}

StatusOr<bool> EtcdClient::PutIfValue(const std::string& key, const std::string& value,
                                      int64_t lease, const std::string& guard_key,
                                      const std::string& guard_value) {
  json compare = {{"key", EncodeBase64(guard_key)},
                  {"target", "VALUE"},
                  {"result", "EQUAL"},
                  {"value", EncodeBase64(guard_value)}};
  json put = {{"key", EncodeBase64(key)}, {"value", EncodeBase64(value)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  json request = json::object();
  request["compare"] = json::array({compare});
  request["success"] = json::array({json{{"request_put", put}}});
  LAUNCH_ASSIGN_OR_RETURN(Reply r, Call("/v3/kv/txn", request.dump()));
  auto succeeded = r.body.find("succeeded");  // left out when false
  return succeeded != r.body.end() && succeeded->is_boolean() && succeeded->get<bool>();
}

Status EtcdClient::DeletePrefix(const std::string& prefix) {
  json request = {{"key", EncodeBase64(prefix.empty() ? std::string(1, '\0') : prefix)},
                  {"range_end", EncodeBase64(PrefixEnd(prefix))}};
  return Call("/v3/kv/deleterange", request.dump()).status();
}

}  // namespace launch::rendezvous
