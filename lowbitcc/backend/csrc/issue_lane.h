// IssueLane: the thread on which a group's plan cores run their whole runs (plan_core.h: the
// tree schedule's, the ring's, an all-reduce's two phases on more than two ranks), one at a time
// in the order they were queued, so that a steady call served by one (steady_runner.h) returns
// to its caller once queued and the caller (DDP's backward) goes on computing while the run
// travels, as beside a gloo call.
//
// Gloo matches the collectives of a group by the order each rank issues them in, so every
// transfer on the gloo group the lane issues on (the group's world transport, the worker's) is
// issued after the lane's runs queued before it: the group's worker waits until the lane is idle
// before each job it runs (lowbitcc/backend/issue_queue.py), and a plan core's run that issues
// on the calling thread (the direct schedule's) waits for it first (`PlanCore::run`). Only the
// main thread queues runs (the steady runner's calls), so the lane cannot become busy while the
// thread that waited for it goes on. A group of the inline issuer has no lane: its calling
// thread issues every call itself (lowbitcc/backend/inline_issue.py).
//
// Threads: `submit` and `wait_idle` from any thread, the GIL held or not (`wait_idle` lets it go
// while it waits); the lane's thread is started at the first `submit`, runs its jobs without
// autograd and without the GIL (a job takes it where it reads or writes a Python object), and is
// joined by `close` (the group's shutdown, or the lane's destruction), which lets the jobs queued
// before it run first. A job must not throw: its errors are its run's Work's.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

namespace lowbitcc {

class __attribute__((visibility("hidden"))) IssueLane {
 public:
  IssueLane() = default;
  IssueLane(const IssueLane&) = delete;
  IssueLane& operator=(const IssueLane&) = delete;
  ~IssueLane() { close(); }

  // Queue `job`, to run after every job queued before it.
  void submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      TORCH_CHECK(!closed_, "lowbitcc: this process group has been shut down");
      if (!thread_.joinable()) {
        thread_ = std::thread([this] { loop(); });
      }
      jobs_.push_back(std::move(job));
      busy_.fetch_add(1, std::memory_order_acq_rel);
    }
    queued_.notify_one();
  }

  // Whether every job queued so far has run to its end.
  bool idle() const { return busy_.load(std::memory_order_acquire) == 0; }

  // Wait until every job queued so far has run to its end (each ends: its transfers are bounded
  // by the group's timeout); the GIL, where the caller holds it, let go meanwhile.
  void wait_idle() {
    if (idle()) {
      return;
    }
    std::optional<py::gil_scoped_release> released;
    if (Py_IsInitialized() && PyGILState_Check()) {
      released.emplace();
    }
    std::unique_lock<std::mutex> lock(mutex_);
    ran_.wait(lock, [this] { return idle(); });
  }

  // Take no more jobs; run those queued, then end the thread (the GIL let go meanwhile).
  // Idempotent.
  void close() {
    std::thread ending;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closed_ = true;
      ending = std::move(thread_);
    }
    queued_.notify_all();
    if (!ending.joinable()) {
      return;
    }
    std::optional<py::gil_scoped_release> released;
    if (Py_IsInitialized() && PyGILState_Check()) {
      released.emplace();
    }
    ending.join();
  }

 private:
  void loop() {
    c10::AutoGradMode no_grad(false);  // (this thread's mode: outputs are written in place)
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        queued_.wait(lock, [this] { return closed_ || !jobs_.empty(); });
        if (jobs_.empty()) {
          return;  // closed, every job run
        }
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
      job = nullptr;  // (what it held is let go before the lane counts it done)
      {
        std::lock_guard<std::mutex> lock(mutex_);
        busy_.fetch_sub(1, std::memory_order_acq_rel);
      }
      ran_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable queued_, ran_;
  std::deque<std::function<void()>> jobs_;
  std::atomic<int64_t> busy_{0};  // jobs queued and not yet run to their end
  bool closed_ = false;
  std::thread thread_;
};

}  // namespace lowbitcc
