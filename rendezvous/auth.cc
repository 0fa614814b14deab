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

std::string ComputeProof(std::string_view token, ProofRole role, std::string_view first,
                         std::string_view second) {
  // A label and fixed-size length prefixes keep the MAC input unambiguous.
  std::string message = role == ProofRole::kAgent ? "launch-rdzv-agent" : "launch-rdzv-server";
  message.push_back('\0');
  for (std::string_view part : {first, second}) {
    uint32_t n = static_cast<uint32_t>(part.size());
    for (int shift = 24; shift >= 0; shift -= 8)
      message.push_back(static_cast<char>((n >> shift) & 0xff));
    message.append(part.data(), part.size());
  }
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int out_len = 0;
  // HMAC() with an empty key: OpenSSL needs a non-null pointer even for length 0.
  static const unsigned char kEmpty[1] = {0};
  const void* key = token.empty() ? static_cast<const void*>(kEmpty) : token.data();
  unsigned char* ok =
      HMAC(EVP_sha256(), key, static_cast<int>(token.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &out_len);
  LAUNCH_CHECK(ok != nullptr && out_len == 32, "HMAC-SHA256 failed");
  return std::string(reinterpret_cast<char*>(out), out_len);
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  if (a.empty()) return true;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace launch::rendezvous
