#pragma once

// Shared-secret authentication for the rendezvous: HMAC-SHA256 challenge-response.
//
//   server -> agent  CHALLENGE nonce_s               (32 random bytes)
//   agent  -> server HELLO     nonce_a, HMAC(token, "launch-rdzv-agent"  | nonce_s | nonce_a)
//   server -> agent  WELCOME            HMAC(token, "launch-rdzv-server" | nonce_a | nonce_s)
//
// The token never crosses the wire; each side proves it knows the token for nonces the other
// side chose, so recorded proofs cannot be replayed. The two directions use different labels,
// so a proof cannot be reflected back. An empty token is a valid (empty) key: two sides without
// a token agree, a side with a token and a side without do not.
// Proofs are compared in constant time. Thread-safe (no state).

#include <string>
#include <string_view>

namespace launch::rendezvous {

enum class ProofRole { kAgent, kServer };

// kNonceSize bytes from OpenSSL's CSPRNG.
std::string RandomNonce();

// HMAC-SHA256(token, label(role) | first | second): 32 raw bytes.
// The agent proves (role kAgent, first = server nonce, second = agent nonce); the server
// proves (role kServer, first = agent nonce, second = server nonce).
std::string ComputeProof(std::string_view token, ProofRole role, std::string_view first,
                         std::string_view second);

// True when `a` and `b` are equal; the time taken depends only on their lengths.
bool ConstantTimeEquals(std::string_view a, std::string_view b);

}  // namespace launch::rendezvous
