// PlannedWork: the Work of a plan core's run (plan_core.h), RunTimings: what the core's runs
// measured and no one has yet handed to the statistics and the cost model, and `outputs_type`:
// the type of a Work's future's value (this Work's and followed_work.h's).
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <exception>
#include <thread>
#include <utility>
#include <vector>

namespace lowbitcc {

// The type of the value of a Work's future, a list of tensors (its outputs): made once, every
// future shares it.
inline const c10::TypePtr& outputs_type() {
  static const c10::TypePtr type = c10::ListType::create(c10::TensorType::get());
  return type;
}

// The Work of a plan core's run: done when its decode is (`future`, whose value is the call's
// outputs, or its error what the decode raised); `wait` raises that error, as the Python path's
// Work does.
class PlannedWork : public c10d::Work {
 public:
  PlannedWork(c10::intrusive_ptr<c10::ivalue::Future> future, c10d::OpType type)
      : c10d::Work(-1, type), future_(std::move(future)) {}

  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override {
    return future_->completed() ? future_->exception_ptr() : nullptr;
  }
  // (`timeout`: as gloo's Work, a wait that outlasts it raises; the call goes on.)
  bool wait(std::chrono::milliseconds timeout) override {
    if (timeout != ::kNoTimeout) {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (!future_->completed()) {
        TORCH_CHECK(std::chrono::steady_clock::now() < deadline,
                    "lowbitcc: a compressed call did not complete within its wait's timeout (",
                    timeout.count(), " ms)");
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
    future_->waitAndThrow();
    return true;
  }
  void synchronize() override {}
  std::vector<at::Tensor> result() override {
    future_->waitAndThrow();
    return future_->value().toTensorVector();
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// What runs measured and no one has yet handed to the statistics and the cost model.
struct RunTimings {
  double codec_s = 0.0;
  double wire_s = 0.0;
  std::vector<double> modelled_s;  // each timed run's wall time, for the cost model
};

}  // namespace lowbitcc
