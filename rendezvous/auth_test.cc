#include "rendezvous/auth.h"

#include <doctest/doctest.h>

#include "rendezvous/protocol.h"

namespace launch::rendezvous {
namespace {

TEST_CASE("ProofsMatchOnlyWithTheSameTokenAndNonces") {
  std::string ns = RandomNonce(), na = RandomNonce();
  CHECK(ns.size() == kNonceSize);
  CHECK(ns != na);
  std::string p = ComputeProof("secret", ProofRole::kAgent, ns, na);
  CHECK(p.size() == 32);
  CHECK(ConstantTimeEquals(p, ComputeProof("secret", ProofRole::kAgent, ns, na)));
  CHECK_FALSE(ConstantTimeEquals(p, ComputeProof("secreT", ProofRole::kAgent, ns, na)));
  CHECK_FALSE(ConstantTimeEquals(p, ComputeProof("", ProofRole::kAgent, ns, na)));
  CHECK_FALSE(ConstantTimeEquals(p, ComputeProof("secret", ProofRole::kAgent, na, ns)));
  // A proof cannot be reflected in the other direction.
  CHECK_FALSE(ConstantTimeEquals(p, ComputeProof("secret", ProofRole::kServer, ns, na)));
  // Both sides without a token agree.
  CHECK(ConstantTimeEquals(ComputeProof("", ProofRole::kAgent, ns, na),
                           ComputeProof("", ProofRole::kAgent, ns, na)));
}

TEST_CASE("ProofIsStandardHmacSha256") {
  // RFC 4231 test case 2 uses key "Jefe"; our message framing differs, so check the length
  // and determinism here and that the token text never appears in the proof.
  std::string p = ComputeProof("Jefe", ProofRole::kServer, "a", "b");
  CHECK(p.size() == 32);
  CHECK(p.find("Jefe") == std::string::npos);
}

TEST_CASE("ConstantTimeEqualsComparesLengthAndBytes") {
  CHECK(ConstantTimeEquals("", ""));
  CHECK(ConstantTimeEquals("abc", "abc"));
  CHECK_FALSE(ConstantTimeEquals("abc", "abd"));
  CHECK_FALSE(ConstantTimeEquals("abc", "ab"));
}

}  // namespace
}  // namespace launch::rendezvous
