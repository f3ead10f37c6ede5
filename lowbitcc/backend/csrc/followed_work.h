// FollowedWork: the Work of a gloo call that the calling thread started itself at its place's
// exact entry (lowbitcc/backend/issue_queue.py's `IssueQueue.follow`; its Python class is
// works.py's `native_followed`). Waiting, completion and errors are
// the inner gloo Work's own; the future c10d's C++ callers ask for (DDP's reducer) is made on
// first use and completed with the call's outputs by a C++ callback on the inner Work's future,
// on the thread that completes it (gloo's), without Python. A Python caller's `get_future` is the
// Python subclass's (a tagged LocoFuture, works.py). An output that a deviating peer left NaN
// (lowbitcc/backend/deviated_output.py, whose `PROBE` and `MESSAGE` `set_deviation` hands over
// once) is this Work's error instead: `wait` throws `DeviatedCallError` (raised in Python as the
// class `set_deviation` names, `CollectiveMismatchError`), the future completes with it.
//
// A point-to-point call's (a gloo send, receive or receive from any source: runner_moves.h) is
// waited for once: gloo's `RecvWork::wait` waits for another message at each call, and its timed
// wait, when it times out, fails every pair of its group. So this Work's inner one is waited for
// once, without a bound of its own (gloo's is the group's timeout), by the runner's completer
// (point_completer.h, which holds it until then: gloo's transfer writes into and out of the Work's
// own buffer, and a send whose Work is gone is never written), or by a caller that waits without a
// bound first; every `wait` waits for that one, up to its own bound, then rethrows the inner Work's
// error (`wait_once`). A wait that times out leaves the call in flight, as a queued call's
// (works.py's `LocoWork.wait`). It reads as complete once that wait has returned (`isCompleted`,
// gloo's), as a queued call's does once the group's waiter saw its message; its `sourceRank` and
// `result` wait first, without the GIL, as a queued receive's (works.py's `LocoWork._source_rank`);
// it has no C++ future (gloo's has none), and its Python future is the waiter's (works.py's
// `native_followed`), which waits on this Work.
#pragma once

#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/Dispatch.h>
#include <ATen/ops/isnan.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>
#include <exception>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "planned_work.h"

namespace lowbitcc {

// What deviated_output.py says a deviated output is, set once by `set_deviation` (probe 0: not
// set, no output reads as deviated); `error_type` is kept for the process (never released).
struct Deviation {
  int64_t probe = 0;
  std::string message;
  PyObject* error_type = nullptr;
};

inline Deviation& deviation() {
  static Deviation kept;
  return kept;
}

class DeviatedCallError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// deviated_output.py's `deviated`: a floating-point CPU output of at least 2 * probe elements,
// NaN at its last element (read first: almost never), at every element past its first probe, at
// none of those.
inline bool deviated_output(const at::Tensor& out) {
  const int64_t n = out.numel();
  const int64_t probe = deviation().probe;
  if (probe == 0 || n < 2 * probe || !out.is_cpu() || !out.is_contiguous() ||
      !at::isFloatingType(out.scalar_type())) {
    return false;
  }
  const bool last = AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, out.scalar_type(), "lowbitcc_deviated_output",
      [&] { return std::isnan(static_cast<double>(out.const_data_ptr<scalar_t>()[n - 1])); });
  if (!last) {
    return false;
  }
  at::Tensor flat = out.view({-1});
  return at::isnan(flat.slice(0, probe)).all().item<bool>() &&
         !at::isnan(flat.slice(0, 0, probe)).any().item<bool>();
}

class FollowedWork : public c10d::Work {
 public:
  // `checked`: an exact entry's call, whose output is read for a deviation (a plan core's
  // compressed run is not: a peer's deviation reaches it as its messages).
  FollowedWork(c10::intrusive_ptr<c10d::Work> inner, std::vector<at::Tensor> outputs, uint64_t tag,
               bool checked)
      : c10d::Work(-1, inner->retrieveOpType()),
        inner_(std::move(inner)),
        outputs_(std::move(outputs)),
        tag_(tag),
        checked_(checked),
        once_(point_to_point(inner_->retrieveOpType())) {}

  // Whether a Work of `type` is a point-to-point call's (the file's comment).
  static bool point_to_point(c10d::OpType type) {
    return type == c10d::OpType::SEND || type == c10d::OpType::RECV ||
           type == c10d::OpType::RECVANYSOURCE;
  }

  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess() && !deviated(); }
  std::exception_ptr exception() const override {
    std::exception_ptr error = inner_->exception();
    if (!error && inner_->isCompleted() && deviated()) {
      error = std::make_exception_ptr(DeviatedCallError(deviation().message));
    }
    return error;
  }
  bool wait(std::chrono::milliseconds timeout) override {
    if (once_) {
      return wait_once(timeout);
    }
    const bool done = inner_->wait(timeout);
    if (deviated(true)) {
      throw DeviatedCallError(deviation().message);
    }
    return done;
  }
  int sourceRank() const override {
    if (once_ && inner_->retrieveOpType() != c10d::OpType::SEND) {
      const_cast<FollowedWork*>(this)->wait_once(::kNoTimeout);  // (a receive's: once done)
    }
    return inner_->sourceRank();
  }
  void synchronize() override { inner_->synchronize(); }
  void abort() override { inner_->abort(); }

  std::vector<at::Tensor> result() override {
    if (once_) {
      wait_once(::kNoTimeout);
    } else {
      wait(::kNoTimeout);
    }
    return outputs_;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!future_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(outputs_type());
      auto future = future_;
      auto outputs = outputs_;
      const bool checked = checked_;
      inner_->getFuture()->addCallback([future, outputs, checked](c10::ivalue::Future& done) {
        try {
          if (done.hasError()) {
            future->setError(done.exception_ptr());
          } else if (checked && !outputs.empty() && deviated_output(outputs[0])) {
            future->setError(std::make_exception_ptr(DeviatedCallError(deviation().message)));
          } else {
            future->markCompleted(c10::IValue(outputs));
          }
        } catch (...) {  // (the future completes whatever the check met)
          if (!future->completed()) {
            future->setError(std::current_exception());
          }
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

  // Whether the call completed without an error and its output is a deviated one (read once
  // the call is complete, false before; `complete`: the caller knows it is, its wait having
  // returned: a gloo reduce-scatter's Work never reads as completed).
  bool deviated(bool complete = false) const {
    int verdict = verdict_.load();
    if (verdict < 0) {
      if (!complete && !inner_->isCompleted()) {
        return false;
      }
      verdict = checked_ && !outputs_.empty() && !inner_->exception() &&
                        deviated_output(outputs_[0])
                    ? 1
                    : 0;
      verdict_.store(verdict);
    }
    return verdict == 1;
  }

  // A point-to-point call's wait (the file's comment): the inner Work waited for once, without
  // a bound of its own (gloo's timed wait, when it times out, fails every pair of its group):
  // by the runner's completer (point_completer.h, `settle`), or by a caller that waits without a
  // bound before it does; every waiter waits for that one wait, up to its bound, then rethrows
  // its error. Waits without the GIL.
  bool wait_once(std::chrono::milliseconds timeout) {
    std::optional<py::gil_scoped_release> release;
    if (PyGILState_Check()) {  // (`_source_rank` and `result` are bound holding it)
      release.emplace();
    }
    std::unique_lock<std::mutex> lock(wait_mutex_);
    if (!waiting_ && timeout == ::kNoTimeout) {
      lock.unlock();
      settle();
      lock.lock();
    }
    if (timeout == ::kNoTimeout) {
      waited_cv_.wait(lock, [this] { return waited_; });
    } else if (!waited_cv_.wait_for(lock, timeout, [this] { return waited_; })) {
      C10_THROW_ERROR(DistBackendError,
                      "lowbitcc: Work.wait timed out after " + std::to_string(timeout.count()) +
                          " ms (the point-to-point call is still in flight; a peer may be "
                          "stalled)");
    }
    if (std::exception_ptr error = inner_->exception()) {
      std::rethrow_exception(error);
    }
    return completed_;
  }

  // The one wait of a point-to-point call's inner Work (`wait_once`), unless a thread has begun
  // it: returns once it has, its error kept by gloo (`exception()`), whether it completed (false:
  // aborted) in `completed_`. Called without the GIL.
  void settle() {
    {
      std::lock_guard<std::mutex> lock(wait_mutex_);
      if (waiting_) {
        return;
      }
      waiting_ = true;
    }
    bool completed = false;
    try {
      completed = inner_->wait();
    } catch (...) {
    }
    {
      std::lock_guard<std::mutex> lock(wait_mutex_);
      completed_ = completed;
      waited_ = true;
    }
    waited_cv_.notify_all();
  }

  uint64_t tag() const { return tag_; }
  bool checked() const { return checked_; }
  c10::intrusive_ptr<c10d::Work> inner() const { return inner_; }
  std::vector<at::Tensor> outputs() const { return outputs_; }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::vector<at::Tensor> outputs_;
  uint64_t tag_;
  std::mutex mutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool checked_;
  mutable std::atomic<int> verdict_{-1};  // `deviated`'s: -1 not read yet
  const bool once_;  // a point-to-point call's (`wait_once`)
  std::mutex wait_mutex_;  // `wait_once`'s: guards `waiting_` and `waited_`
  std::condition_variable waited_cv_;  // notified once `waited_`
  bool waiting_ = false;  // a thread waits on the inner Work (or has)
  bool waited_ = false;  // the inner Work's wait has returned or thrown
  bool completed_ = false;  // what it returned (false: thrown, or aborted)
};

}  // namespace lowbitcc
