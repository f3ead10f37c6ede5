// IssueLane: the thread on which a group's plan cores run their whole runs (plan_core.h: the tree
// schedule's, the ring's, the hierarchical's, an all-reduce's two phases on more than two ranks),
// one at a time in the order they were queued, so that a steady call served by one
// (steady_runner.h) returns to its caller once queued and the caller (DDP's backward) goes on
// computing while the run travels, as beside a gloo call.
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
// while it waits); the lane's thread is started at the first `submit` and runs its jobs without
// autograd and without the GIL (a job takes it where it reads or writes a Python object, and
// not once the interpreter is finalizing: `python_running`). `close` (the group's shutdown, the
// queue's end or the process's exit: issue_queue.py) takes no more jobs and lets those queued
// run, waiting for them up to its timeout; past it, where it is called on the lane's own thread,
// and when the lane is destroyed, the thread is left to end by itself (it shares the lane's
// state). A job must not throw:
// its errors are its run's Work's. A run ends once its transfers do, each within the group's
// timeout (a ring's waits in several in turn).
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

namespace lowbitcc {

// Whether a thread may take the GIL to touch Python objects: the interpreter is up and not
// finalizing (a thread that takes the GIL then is ended where it stands).
inline bool python_running() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

class __attribute__((visibility("hidden"))) IssueLane {
 public:
  IssueLane() : state_(std::make_shared<State>()) {}
  IssueLane(const IssueLane&) = delete;
  IssueLane& operator=(const IssueLane&) = delete;
  // (It waits for nothing: the thread, if any, runs what was queued and ends by itself. The
  // lane may be let go of on a thread one of its runs waits for, or on its own.)
  ~IssueLane() {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->closed = true;
    }
    state_->queued.notify_all();
    if (thread_.joinable()) {
      thread_.detach();
    }
  }

  // Queue `job`, to run after every job queued before it.
  void submit(std::function<void()> job) {
    State& s = *state_;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      TORCH_CHECK(!s.closed, "lowbitcc: this process group has been shut down");
      if (!thread_.joinable()) {
        thread_ = std::thread([state = state_] { loop(*state); });
      }
      s.jobs.push_back(std::move(job));
      s.busy.fetch_add(1, std::memory_order_acq_rel);
      ++s.submitted;
    }
    s.queued.notify_one();
  }

  // How many jobs have been queued since it was made (tests read it).
  int64_t submitted() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->submitted;
  }

  // Its group was shut down (`IssueQueue.shutdown`, before it closes the lane): no run of the
  // group starts any more, here or on a calling thread (`PlanCore::run`). A lane closed at the
  // process's exit alone is not: its group's calling threads still issue their runs.
  void shut_down() { shut_down_ = true; }
  bool was_shut_down() const { return shut_down_; }

  // Whether every job queued so far has run to its end.
  bool idle() const { return state_->busy.load(std::memory_order_acquire) == 0; }

  // Wait until every job queued so far has run to its end; the GIL, where the caller holds it,
  // let go meanwhile.
  void wait_idle() {
    if (idle()) {
      return;
    }
    std::optional<py::gil_scoped_release> released;
    if (Py_IsInitialized() && PyGILState_Check()) {
      released.emplace();
    }
    State& s = *state_;
    std::unique_lock<std::mutex> lock(s.mutex);
    s.ran.wait(lock, [&s] { return s.busy.load() == 0; });
  }

  // Take no more jobs; wait up to `timeout_s` seconds (negative: without bound) for those queued
  // to run, the GIL let go meanwhile; then end the thread with them, or leave it to end by
  // itself (see the file's comment). Whether every job had run. Idempotent.
  bool close(double timeout_s) {
    State& s = *state_;
    std::thread ending;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.closed = true;
      ending = std::move(thread_);
    }
    s.queued.notify_all();
    if (!ending.joinable()) {
      return idle();
    }
    if (ending.get_id() == std::this_thread::get_id()) {
      ending.detach();  // (the lane let go of by one of its own jobs)
      return false;
    }
    std::optional<py::gil_scoped_release> released;
    if (Py_IsInitialized() && PyGILState_Check()) {
      released.emplace();
    }
    bool drained = true;
    {
      std::unique_lock<std::mutex> lock(s.mutex);
      auto done = [&s] { return s.busy.load() == 0; };
      if (timeout_s < 0) {
        s.ran.wait(lock, done);
      } else {
        drained = s.ran.wait_for(lock, std::chrono::duration<double>(timeout_s), done);
      }
    }
    if (drained) {
      ending.join();  // (it returns at once: closed, no job left)
    } else {
      ending.detach();
    }
    return drained;
  }

 private:
  // What the lane's thread shares with the lane (the thread holds it too: see `close`).
  struct State {
    std::mutex mutex;
    std::condition_variable queued, ran;
    std::deque<std::function<void()>> jobs;
    std::atomic<int64_t> busy{0};  // jobs queued and not yet run to their end
    int64_t submitted = 0;         // jobs queued since the lane was made
    bool closed = false;
  };

  static void loop(State& s) {
    at::init_num_threads();  // (torch's intra-op threads, as its own threads set them)
    c10::AutoGradMode no_grad(false);  // (this thread's mode: outputs are written in place)
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(s.mutex);
        s.queued.wait(lock, [&s] { return s.closed || !s.jobs.empty(); });
        if (s.jobs.empty()) {
          return;  // closed, every job run
        }
        job = std::move(s.jobs.front());
        s.jobs.pop_front();
      }
      job();
      job = nullptr;  // (what it held is let go before the lane counts it done)
      {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.busy.fetch_sub(1, std::memory_order_acq_rel);
      }
      s.ran.notify_all();
    }
  }

  std::shared_ptr<State> state_;
  std::thread thread_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace lowbitcc
