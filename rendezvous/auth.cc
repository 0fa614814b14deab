#include "rendezvous/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "base/check.h"
#include "rendezvous/protocol.h"

namespace launch::rendezvous {

std::string RandomNonce() {
  std::string nonce(kNonceSize, '\0');
  int rc =
      RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size()));
  LAUNCH_CHECK(rc == 1, "RAND_bytes failed");
  return nonce;
}

namespace {

std::string HmacSha256(std::string_view key, std::string_view message) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int out_len = 0;
  // HMAC() with an empty key: OpenSSL needs a non-null pointer even for length 0.
  static const unsigned char kEmpty[1] = {0};
  const void* k = key.empty() ? static_cast<const void*>(kEmpty) : key.data();
  unsigned char* ok =
      HMAC(EVP_sha256(), k, static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &out_len);
  LAUNCH_CHECK(ok != nullptr && out_len == 32, "HMAC-SHA256 failed");
  return std::string(reinterpret_cast<char*>(out), out_len);
}

// A label and fixed-size length prefixes keep the MAC input unambiguous.
std::string Labelled(const char* label, std::string_view first, std::string_view second) {
  std::string message = label;
  message.push_back('\0');
  for (std::string_view part : {first, second}) {
    uint32_t n = static_cast<uint32_t>(part.size());
    for (int shift = 24; shift >= 0; shift -= 8)
      message.push_back(static_cast<char>((n >> shift) & 0xff));
    message.append(part.data(), part.size());
  }
  return message;
}

}  // namespace

std::string ComputeProof(std::string_view token, ProofRole role, std::string_view first,
                         std::string_view second) {
  const char* label = role == ProofRole::kAgent ? "launch-rdzv-agent" : "launch-rdzv-server";
  return HmacSha256(token, Labelled(label, first, second));
}

std::string SessionKey(std::string_view token, std::string_view server_nonce,
                       std::string_view agent_nonce) {
  return HmacSha256(token, Labelled("launch-rdzv-session", server_nonce, agent_nonce));
}

std::string FrameMac(std::string_view session_key, MacDirection direction, uint64_t sequence,
                     std::string_view frame) {
  std::string message = direction == MacDirection::kToAgent ? "to-agent" : "to-server";
  message.push_back('\0');
  for (int shift = 56; shift >= 0; shift -= 8)
    message.push_back(static_cast<char>((sequence >> shift) & 0xff));
  message.append(frame.data(), frame.size());
  return HmacSha256(session_key, message);
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  if (a.empty()) return true;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace launch::rendezvous
