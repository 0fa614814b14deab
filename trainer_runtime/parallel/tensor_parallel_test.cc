// Tensor parallelism (model/tensor_parallel.h over parallel/tensor_group.h): T ranks on threads,
// each in a real process group (Gloo, or shared memory), run the split layers on the same input
// and must give what the whole layer gives in one thread: outputs, the input's gradient, and the
// parameters' gradients put back together (WholeOf). With sequence parallelism, the vocabulary
// split, and the exact number of all-reduces a layer pair costs (one forward, one backward).

#include "trainer_runtime/model/tensor_parallel.h"

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/model/layers.h"
#include "trainer_runtime/parallel/tensor_group.h"
#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

// Runs fn(rank, group, pg) on `size` threads, each a rank of one process group.
void OnRanks(int size, bool shm,
             const std::function<void(int, const TensorGroupPtr&, CountingProcessGroup&)>& fn) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank)
    threads.emplace_back([&, rank] {
      DistEnv env;
      env.rank = rank;
      env.world_size = size;
      env.master_addr = "127.0.0.1";
      env.tuning.shm_allreduce = shm;
      auto pg = CreateGroupOver(store, "tensor0", rank, size, env, std::chrono::seconds(60));
      if (!pg.ok()) {
        errors[static_cast<size_t>(rank)] = pg.status().message();
        return;
      }
      try {
        fn(rank, ProcessTensorGroup(*pg), **pg);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(rank)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) CHECK(e == "");
}

bool TpClose(const torch::Tensor& got, const torch::Tensor& want) {
  return got.sizes() == want.sizes() && torch::allclose(got, want, /*rtol=*/1e-5, /*atol=*/1e-6);
}

torch::Tensor TpInput(std::vector<int64_t> sizes, double shift) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return torch::sin(torch::arange(n, torch::kFloat) * 0.37 + shift).reshape(sizes);
}

// A whole MLP (fc1, gelu, fc2) and its gradients on one input, the reference.
struct WholeMlp {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor x, out, coef;
  WholeMlp(int64_t c, const torch::Tensor& input) {
    torch::manual_seed(5);
    fc1 = torch::nn::Linear(c, 4 * c);
    fc2 = torch::nn::Linear(4 * c, c);
    x = input.clone().requires_grad_(true);
    out = fc2->forward(torch::gelu(fc1->forward(x)));
    coef = torch::cos(torch::arange(out.numel(), torch::kFloat)).reshape(out.sizes());
    (out * coef).sum().backward();
  }
};

void CheckMlp(int size, bool shm, bool sequence_parallel) {
  const int64_t c = 8;
  const torch::Tensor input = TpInput({2, 4, c}, 0.3);
  WholeMlp whole(c, input);
  OnRanks(size, shm, [&](int rank, const TensorGroupPtr& g, CountingProcessGroup& pg) {
    ColumnParallelLinear fc1(c, 4 * c, g,
                             ColumnParallelOptions().sequence_parallel(sequence_parallel));
    RowParallelLinear fc2(4 * c, c, g, /*bias=*/true, /*input_is_parallel=*/true,
                          sequence_parallel);
    LoadShardsFromWhole(*fc1, *whole.fc1);
    LoadShardsFromWhole(*fc2, *whole.fc2);
    torch::Tensor x = input.clone().requires_grad_(true);
    // With sequence parallelism the layers take and give this rank's share of the sequence.
    torch::Tensor in = sequence_parallel ? ScatterToTensorRegion(x, g, 1) : x;
    const int64_t before = pg.allreduce_count();
    torch::Tensor out = fc2->forward(torch::gelu(fc1->forward(in)));
    const int64_t forward_allreduces = pg.allreduce_count() - before;
    torch::Tensor coef = whole.coef;
    if (sequence_parallel) coef = coef.chunk(size, 1)[static_cast<size_t>(rank)];
    (out * coef).sum().backward();
    if (!sequence_parallel) {
      // Megatron's count: one all-reduce forward (fc2's sum), one backward (fc1's input).
      CHECK(forward_allreduces == 1);
      CHECK(pg.allreduce_count() - before == 2);
      CHECK(TpClose(out.detach(), whole.out.detach()));
    } else {
      CHECK(forward_allreduces == 0);  // a gather and a reduce-scatter instead
      CHECK(TpClose(out.detach(), whole.out.detach().chunk(size, 1)[static_cast<size_t>(rank)]));
    }
    CHECK(TpClose(x.grad(), whole.x.grad()));
    CHECK(fc1->weight.size(0) == 4 * c / size);
    CHECK(fc2->weight.size(1) == 4 * c / size);
    CHECK(TpClose(fc1->WholeOf("weight", fc1->weight.grad()), whole.fc1->weight.grad()));
    CHECK(TpClose(fc1->WholeOf("bias", fc1->bias.grad()), whole.fc1->bias.grad()));
    CHECK(TpClose(fc2->WholeOf("weight", fc2->weight.grad()), whole.fc2->weight.grad()));
    CHECK(TpClose(fc2->WholeOf("bias", fc2->bias.grad()), whole.fc2->bias.grad()));
  });
}

TEST_CASE("ColumnThenRowParallelLinearIsTheWholeMlpOverGlooAndSharedMemory") {
  CheckMlp(2, /*shm=*/false, /*sequence_parallel=*/false);
  CheckMlp(2, /*shm=*/true, /*sequence_parallel=*/false);
  CheckMlp(4, /*shm=*/false, /*sequence_parallel=*/false);
}

TEST_CASE("SequenceParallelMlpIsTheWholeMlpOnEachRanksShareOfTheSequence") {
  CheckMlp(2, /*shm=*/true, /*sequence_parallel=*/true);
  CheckMlp(4, /*shm=*/false, /*sequence_parallel=*/true);
}

TEST_CASE("FusedColumnParallelLinearSplitsEachBlockAndGathersBackInOrder") {
  // Attention's qkv: q, k and v each split by heads; gathered outputs are the whole layer's.
  const int64_t c = 8;
  torch::manual_seed(6);
  torch::nn::Linear qkv(c, 3 * c);
  const torch::Tensor x = TpInput({3, c}, 1.1);
  const torch::Tensor want = qkv->forward(x).detach();
  OnRanks(2, false, [&](int rank, const TensorGroupPtr& g, CountingProcessGroup&) {
    ColumnParallelLinear split(c, 3 * c, g, ColumnParallelOptions().fused(3));
    LoadShardsFromWhole(*split, *qkv);
    const torch::Tensor local = split->forward(x).detach();
    // Rank r's block b is columns [b*C + r*C/2, b*C + (r+1)*C/2) of the whole output.
    for (int64_t b = 0; b < 3; ++b)
      CHECK(
          TpClose(local.narrow(1, b * c / 2, c / 2), want.narrow(1, b * c + rank * c / 2, c / 2)));
    ColumnParallelLinear gathered(c, 3 * c, g,
                                  ColumnParallelOptions().fused(3).gather_output(true));
    LoadShardsFromWhole(*gathered, *qkv);
    CHECK(TpClose(gathered->forward(x).detach(), want));
    CHECK(torch::equal(gathered->WholeOf("weight", gathered->weight), qkv->weight));
  });
}

TEST_CASE("VocabParallelEmbeddingAndCrossEntropyAreTheWholeOnes") {
  const int64_t vocab = 12, c = 4;
  torch::manual_seed(7);
  torch::nn::Embedding emb(vocab, c);
  torch::nn::Linear head(c, vocab);
  const torch::Tensor ids = torch::tensor({0, 5, 11, 6, 3, 7}, torch::kLong).reshape({2, 3});
  const torch::Tensor target = torch::tensor({11, 0, 6, 5, 2, 9}, torch::kLong).reshape({2, 3});
  const torch::Tensor logits = head->forward(emb->forward(ids));
  const torch::Tensor loss = torch::nn::functional::cross_entropy(
      logits.reshape({-1, vocab}), target.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  loss.sum().backward();
  for (int size : {2, 3}) {
    OnRanks(size, false, [&](int, const TensorGroupPtr& g, CountingProcessGroup&) {
      VocabParallelEmbedding split_emb(vocab, c, g);
      ColumnParallelLinear split_head(c, vocab, g);
      LoadShardsFromWhole(*split_emb, *emb);
      LoadShardsFromWhole(*split_head, *head);
      const torch::Tensor split_loss =
          VocabParallelCrossEntropy(split_head->forward(split_emb->forward(ids)), target, g);
      CHECK(TpClose(split_loss.detach().reshape({-1}), loss.detach()));
      split_loss.sum().backward();
      CHECK(TpClose(split_emb->WholeOf("weight", split_emb->weight.grad()), emb->weight.grad()));
      CHECK(TpClose(split_head->WholeOf("weight", split_head->weight.grad()), head->weight.grad()));
      CHECK(TpClose(split_head->WholeOf("bias", split_head->bias.grad()), head->bias.grad()));
    });
  }
}

TEST_CASE("AllToAllRegionTradesSequenceForHeadsAndItsBackwardTradesBack") {
  // [B, S, H, d] on 2 ranks, each with half the sequence: after the exchange each has every
  // position of half the heads; the exchange back restores the input; gradients come home.
  const torch::Tensor whole = TpInput({2, 6, 4, 3}, 0.7);
  OnRanks(2, false, [&](int rank, const TensorGroupPtr& g, CountingProcessGroup& pg) {
    const size_t r = static_cast<size_t>(rank);
    torch::Tensor mine = whole.chunk(2, 1)[r].clone().requires_grad_(true);
    torch::Tensor heads = AllToAllRegion(mine, g, /*scatter=*/2, /*gather=*/1);
    CHECK(torch::equal(heads.detach(), whole.chunk(2, 2)[r]));
    torch::Tensor back = AllToAllRegion(heads, g, /*scatter=*/1, /*gather=*/2);
    CHECK(torch::equal(back.detach(), mine.detach()));
    CHECK(pg.alltoall_count() == 2);
    // d(sum(heads * w))/d(mine) is w's part for this rank's positions, from both ranks' heads.
    const torch::Tensor w = TpInput({2, 6, 4, 3}, 2.1);
    (heads * w.chunk(2, 2)[r]).sum().backward();
    CHECK(torch::equal(mine.grad(), w.chunk(2, 1)[r]));
    CHECK(pg.alltoall_count() == 3);
  });
  CHECK(AllToAllRegion(whole, TensorGroupPtr(), 2, 1).is_same(whole));
}

// A whole transformer block on the whole sequence against `size` context ranks (Ulysses), each
// with its part of the sequence: outputs, the input's gradient, the parameters' gradients summed
// over the ranks, and Ulysses' count (two all-to-alls forward, two backward).
void CheckUlyssesBlock(int size, int64_t heads) {
  const int64_t c = 8, seq = 8;
  const torch::Tensor input = TpInput({2, seq, c}, 0.4);
  const torch::Tensor mask = torch::ones({seq, seq}, torch::kBool).triu(1);
  torch::manual_seed(8);
  Block whole(c, heads, /*dropout=*/0.0);
  torch::Tensor x = input.clone().requires_grad_(true);
  const torch::Tensor out = whole->forward(x, mask);
  const torch::Tensor coef =
      torch::cos(torch::arange(out.numel(), torch::kFloat) * 0.3).reshape(out.sizes());
  (out * coef).sum().backward();
  OnRanks(size, false, [&](int rank, const TensorGroupPtr& g, CountingProcessGroup& pg) {
    const size_t r = static_cast<size_t>(rank);
    Block split(c, heads, 0.0, /*checkpoint=*/false, TensorGroupPtr(), false, /*context=*/g);
    LoadShardsFromWhole(*split, *whole);
    torch::Tensor mine = input.chunk(size, 1)[r].clone().requires_grad_(true);
    const torch::Tensor part = split->forward(mine, mask);
    CHECK(pg.alltoall_count() == 2);
    CHECK(TpClose(part.detach(), out.detach().chunk(size, 1)[r]));
    (part * coef.chunk(size, 1)[r]).sum().backward();
    CHECK(pg.alltoall_count() == 4);
    CHECK(TpClose(mine.grad(), x.grad().chunk(size, 1)[r]));
    const auto want = whole->named_parameters();
    for (const auto& item : split->named_parameters()) {
      torch::Tensor sum = item.value().grad().clone();
      g->AllReduceSum(sum);
      CHECK_MESSAGE(TpClose(sum, want[item.key()].grad()), item.key());
    }
  });
}

TEST_CASE("UlyssesBlockIsTheWholeBlockOnEachRanksPartOfTheSequence") {
  CheckUlyssesBlock(2, /*heads=*/4);
  CheckUlyssesBlock(4, /*heads=*/4);
}

TEST_CASE("WithoutAGroupTheLayersAreTheWholeLayersDrawForDraw") {
  // The same seed gives Linear's and Embedding's own initial weights, and the same outputs.
  torch::manual_seed(11);
  torch::nn::Linear linear(6, 10);
  torch::manual_seed(11);
  ColumnParallelLinear column(6, 10, TensorGroupPtr());
  torch::manual_seed(11);
  RowParallelLinear row(6, 10, TensorGroupPtr());
  CHECK(torch::equal(column->weight, linear->weight));
  CHECK(torch::equal(column->bias, linear->bias));
  CHECK(torch::equal(row->weight, linear->weight));
  CHECK(torch::equal(row->bias, linear->bias));
  const torch::Tensor x = TpInput({2, 6}, 0.2);
  CHECK(torch::equal(column->forward(x), linear->forward(x)));
  CHECK(TpClose(row->forward(x), linear->forward(x)));
  const torch::Tensor y = TpInput({5}, 0.1);
  CHECK(torch::equal(CopyToTensorRegion(y, TensorGroupPtr()), y));
  CHECK(torch::equal(GatherFromSequenceRegion(y.view({1, 5}), TensorGroupPtr()), y.view({1, 5})));
}

TEST_CASE("WholeStateOfGathersEveryShardUnderTheWholeModelsNames") {
  torch::manual_seed(12);
  auto whole = std::make_shared<torch::nn::Module>();
  whole->register_module("fc1", torch::nn::Linear(4, 8));
  whole->register_module("fc2", torch::nn::Linear(8, 4));
  whole->register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})));
  OnRanks(2, true, [&](int, const TensorGroupPtr& g, CountingProcessGroup&) {
    auto split = std::make_shared<torch::nn::Module>();
    split->register_module("fc1", ColumnParallelLinear(4, 8, g));
    split->register_module("fc2", RowParallelLinear(8, 4, g));
    split->register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})));
    LoadShardsFromWhole(*split, *whole);
    const auto state = WholeStateOf(*split);
    const auto want = whole->named_parameters();
    CHECK(state.size() == want.size());
    for (const auto& [name, tensor] : state) CHECK(torch::equal(tensor, want[name]));
    // fc1's weight and bias and fc2's weight are split; fc2's bias and the norm's are not.
    const std::vector<bool> split_flags = SplitParameters(*split, split->parameters());
    CHECK(split_flags == std::vector<bool>{true, true, true, false, false, false});
  });
}

TEST_CASE("CutShardAndJoinShardsRecutAWholeTensorForAnyNumberOfShards") {
  // What a checkpoint's re-cut does (state/reshard.h): T shards joined, then cut into T'.
  const torch::Tensor whole = torch::arange(6 * 12, torch::kFloat).view({6, 12});
  for (const TensorSplit split : {TensorSplit{0, 1}, TensorSplit{1, 1}, TensorSplit{0, 3}}) {
    for (int64_t parts : {1, 2, 3}) {
      if (whole.size(split.dim) % (split.blocks * parts) != 0) continue;
      std::vector<torch::Tensor> shards;
      for (int64_t i = 0; i < parts; ++i) shards.push_back(CutShard(whole, split, parts, i));
      CHECK(torch::equal(JoinShards(shards, split), whole));
      // Two shards of two then three shards: each the one cut from the whole directly.
      if (parts == 2 && whole.size(split.dim) % (split.blocks * 6) == 0)
        for (int64_t i = 0; i < 3; ++i)
          CHECK(torch::equal(CutShard(JoinShards(shards, split), split, 3, i),
                             CutShard(whole, split, 3, i)));
    }
  }
  // A fused weight's shard holds its rows of each block: q, k and v of its heads.
  const torch::Tensor qkv = CutShard(whole, {0, 3}, 2, 1);
  CHECK(torch::equal(
      qkv, torch::cat({whole.slice(0, 1, 2), whole.slice(0, 3, 4), whole.slice(0, 5, 6)})));
  CHECK_FALSE(TensorSplit{}.split());
  CHECK(CutShard(whole, TensorSplit{}, 2, 1).is_same(whole));
  CHECK_THROWS_AS(CutShard(whole, {0, 1}, 4, 0), c10::Error);  // 6 rows do not cut in 4
}

}  // namespace
}  // namespace launch::trainer
