#include "trainer_runtime/parallel/power_sgd.h"

#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

// numpy 1.24's own: [np.random.RandomState(s).randint(1_000_000_000) for ...].
TEST_CASE("NumpyLegacyRandintDrawsWhatNumpyRandomStateDraws") {
  std::mt19937 zero(0);
  int64_t draws = 0;
  std::vector<int64_t> got;
  for (int i = 0; i < 4; ++i) got.push_back(NumpyLegacyRandint(zero, 1000000000, &draws));
  CHECK(got == std::vector<int64_t>{209652396, 398764591, 924231285, 404868288});
  CHECK(draws >= 4);  // and more where an output was rejected
  // The count of outputs consumed is the position: a generator moved on by it goes on alike.
  std::mt19937 again(0);
  again.discard(static_cast<unsigned long long>(draws));
  CHECK(again() == zero());
  std::mt19937 seven(7);
  CHECK(NumpyLegacyRandint(seven, 1000000000, &draws) == 327741615);
  CHECK(NumpyLegacyRandint(seven, 1000000000, &draws) == 976413892);
  int64_t n = 0;
  std::mt19937 any(1);
  CHECK(NumpyLegacyRandint(any, 1, &n) == 0);  // one value only
}

// Columns of unit length, orthogonal to each other: Gram-Schmidt (r <= 2) and QR (r > 2).
TEST_CASE("OrthogonalizePowerSgdMakesTheColumnsOrthonormal") {
  for (int64_t r : {1, 2, 4}) {
    INFO("rank " << r);
    at::Tensor m = torch::randn({3, 7, r}, torch::kDouble);
    OrthogonalizePowerSgd(m, 0.0);
    at::Tensor gram = torch::bmm(m.transpose(1, 2), m);
    CHECK(torch::allclose(gram, torch::eye(r, torch::kDouble).expand({3, r, r}), 1e-9, 1e-12));
  }
  // epsilon: each column divided by its norm + epsilon, so a zero column stays zero (no nan).
  at::Tensor zero = torch::zeros({1, 5, 2});
  OrthogonalizePowerSgd(zero, 1e-8);
  CHECK(torch::equal(zero, torch::zeros({1, 5, 2})));
}

}  // namespace
}  // namespace launch::trainer
