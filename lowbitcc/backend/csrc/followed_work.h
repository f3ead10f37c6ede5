// FollowedWork: the Work of a gloo call that the calling thread started itself at its place's
// exact entry (lowbitcc/backend/issue_queue.py's `IssueQueue.follow`; its Python class is
// works.py's `native_followed`). Waiting, completion and errors are
// the inner gloo Work's own; the future c10d's C++ callers ask for (DDP's reducer) is made on
// first use and completed with the call's outputs by a C++ callback on the inner Work's future,
// on the thread that completes it (gloo's), without Python. A Python caller's `get_future` is the
// Python subclass's (a tagged LocoFuture, works.py).
#pragma once

#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cmath>
#include <exception>
#include <mutex>
#include <utility>
#include <vector>

namespace lowbitcc {

class FollowedWork : public c10d::Work {
 public:
  FollowedWork(c10::intrusive_ptr<c10d::Work> inner, std::vector<at::Tensor> outputs, uint64_t tag)
      : c10d::Work(-1, inner->retrieveOpType()),
        inner_(std::move(inner)),
        outputs_(std::move(outputs)),
        tag_(tag) {}

  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  bool wait(std::chrono::milliseconds timeout) override { return inner_->wait(timeout); }
  void synchronize() override { inner_->synchronize(); }
  void abort() override { inner_->abort(); }

  std::vector<at::Tensor> result() override {
    inner_->wait();
    return outputs_;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!future_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()));
      auto future = future_;
      auto outputs = outputs_;
      inner_->getFuture()->addCallback([future, outputs](c10::ivalue::Future& done) {
        if (done.hasError()) {
          future->setError(done.exception_ptr());
        } else {
          future->markCompleted(c10::IValue(outputs));
        }
      });
    }
    return future_;
  }

  // Whether the call's output ends in NaN (its place's canary, call_schedule.py), as exact.py's
  // `HostCanary.nan` reads a gloo Work: an empty output is not NaN; a call not completed is
  // waited for (without the GIL where bound so), and one whose wait raises reads as NaN.
  bool nan() {
    if (outputs_.empty() || outputs_[0].numel() == 0) {
      return false;
    }
    try {
      if (!inner_->isCompleted()) {
        inner_->wait();
      }
    } catch (const std::exception&) {
      return true;
    }
    const at::Tensor& out = outputs_[0];
    return std::isnan(out.reshape(-1)[out.numel() - 1].item<double>());
  }

  uint64_t tag() const { return tag_; }
  c10::intrusive_ptr<c10d::Work> inner() const { return inner_; }
  std::vector<at::Tensor> outputs() const { return outputs_; }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::vector<at::Tensor> outputs_;
  uint64_t tag_;
  std::mutex mutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace lowbitcc
