#include "trainer_runtime/parallel/tensor_group.h"

#include <utility>

namespace launch::trainer {
namespace {

bool Reduced(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf;
}

class ProcessGroupTensorGroup : public TensorGroup {
 public:
  explicit ProcessGroupTensorGroup(c10::intrusive_ptr<CountingProcessGroup> pg)
      : pg_(std::move(pg)) {}
  // Its group re-formed (ReformTensorGroup).
  void Reform(c10::intrusive_ptr<CountingProcessGroup> pg) { pg_ = std::move(pg); }
  int size() const override { return pg_->getSize(); }
  int rank() const override { return pg_->getRank(); }
  void AllReduceSum(torch::Tensor& values) override { AllReduce(values, c10d::ReduceOp::SUM); }
  void AllReduceMax(torch::Tensor& values) override { AllReduce(values, c10d::ReduceOp::MAX); }
  torch::Tensor AllGather(const torch::Tensor& part) override {
    const torch::Tensor input = part.contiguous();
    auto sizes = input.sizes().vec();
    sizes[0] *= size();
    torch::Tensor whole = torch::empty(sizes, input.options());
    pg_->AllGatherFlat(input, whole)->wait();
    return whole;
  }
  torch::Tensor ReduceScatter(const torch::Tensor& whole) override {
    // Its input is scratch afterwards (process_group.h): a copy, the caller's stays.
    torch::Tensor input = Reduced(whole) ? whole.to(torch::kFloat) : whole.contiguous().clone();
    auto sizes = input.sizes().vec();
    sizes[0] /= size();
    torch::Tensor part = torch::empty(sizes, input.options());
    pg_->ReduceScatterFlat(input, part)->wait();
    return Reduced(whole) ? part.to(whole.scalar_type()) : part;
  }
  torch::Tensor AllToAll(const torch::Tensor& blocks) override {
    TORCH_CHECK(blocks.dim() > 0 && blocks.size(0) == size(), "AllToAll: ", blocks.sizes(),
                " is not one block per rank of ", size());
    const torch::Tensor input = blocks.contiguous();
    torch::Tensor output = torch::empty_like(input);
    pg_->AllToAllFlat(input, output)->wait();
    return output;
  }

 private:
  void AllReduce(torch::Tensor& values, c10d::ReduceOp op) {
    c10d::AllreduceOptions opts;
    opts.reduceOp = op;
    std::vector<at::Tensor> v = {Reduced(values) ? values.to(torch::kFloat) : values};
    pg_->allreduce(v, opts)->wait();
    if (v[0].unsafeGetTensorImpl() != values.unsafeGetTensorImpl()) values.copy_(v[0]);
  }

  c10::intrusive_ptr<CountingProcessGroup> pg_;
};

}  // namespace

void ReformTensorGroup(const TensorGroupPtr& group, c10::intrusive_ptr<CountingProcessGroup> pg) {
  auto* g = dynamic_cast<ProcessGroupTensorGroup*>(group.get());
  TORCH_CHECK(g && pg && pg->getSize() == g->size() && pg->getRank() == g->rank(),
              "ReformTensorGroup: not a process group's tensor group of this size and rank");
  g->Reform(std::move(pg));
}

TensorGroupPtr ProcessTensorGroup(c10::intrusive_ptr<CountingProcessGroup> pg) {
  if (!pg) return TensorGroupPtr();
  return c10::make_intrusive<ProcessGroupTensorGroup>(std::move(pg));
}

}  // namespace launch::trainer
