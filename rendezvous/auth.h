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
//
// After the handshake every frame carries a MAC (see connection.h): a session key derived from
// the token and both nonces, a direction label and an implicit per-direction sequence number,
// so a frame cannot be forged, altered, replayed, reordered, dropped unnoticed or reflected.

#include <cstdint>
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

// The key for the MACs of one connection's frames after the handshake:
// HMAC-SHA256(token, "launch-rdzv-session" | server nonce | agent nonce), 32 raw bytes.
std::string SessionKey(std::string_view token, std::string_view server_nonce,
                       std::string_view agent_nonce);

enum class MacDirection { kToAgent, kToServer };
inline constexpr size_t kMacSize = 32;

// HMAC-SHA256(session_key, direction | sequence | frame): kMacSize raw bytes. `frame` is the
// header and payload as sent; `sequence` counts the MACed frames of one direction from 0.
std::string FrameMac(std::string_view session_key, MacDirection direction, uint64_t sequence,
                     std::string_view frame);

// True when `a` and `b` are equal; the time taken depends only on their lengths.
bool ConstantTimeEquals(std::string_view a, std::string_view b);

}  // namespace launch::rendezvous
