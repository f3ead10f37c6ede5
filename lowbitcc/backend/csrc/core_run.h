// A plan core's run (plan_core.h's `PlanCore::Run`, declared there): one call's own state,
// shared by its transfers' decodes and its issuing thread; `result` is its Work's future.
// Included by plan_core.h after the class, before the members that use it.
#pragma once

#include "plan_core.h"

namespace lowbitcc {

struct PlanCore::Run {
  Run(at::Tensor tensor_, at::Tensor output_, int64_t seq_, int threads_, bool timed_,
      std::shared_ptr<ServedCounts> counts_, std::optional<FeedbackKey> key_, bool feedback)
      : tensor(std::move(tensor_)), flat(tensor.view({-1})), output(std::move(output_)),
        seq(seq_), threads(threads_), timed(timed_), start(std::chrono::steady_clock::now()),
        counts(std::move(counts_)), key(std::move(key_)),
        taken(feedback ? &states : nullptr),
        result(c10::make_intrusive<c10::ivalue::Future>(outputs_type())) {}
  // A transfer's error (its all-gather's, or its decode's): the run's first is its own.
  void failed(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!first_error) {
      first_error = std::move(error);
    }
  }
  // Whether it has an error yet.
  bool has_error() {
    std::lock_guard<std::mutex> lock(mutex);
    return static_cast<bool>(first_error);
  }
  // Its error states' Python objects let go of: with the GIL, or, the interpreter finalizing,
  // left as they are (`python_running`).
  void let_go_of_states() {
    if (states.slots.empty()) {
      return;
    }
    if (python_running()) {
      py::gil_scoped_acquire acquire;
      states.slots.clear();
      return;
    }
    for (Slot& slot : states.slots) {
      slot.key.release();
      slot.state.release();
    }
    states.slots.clear();
  }
  // Wait (without the GIL) for the place's run before it, once.
  void wait_previous() {
    if (previous) {
      previous->wait();
      previous.reset();
    }
  }
  at::Tensor tensor, flat;
  at::Tensor output;  // a reduce-scatter's (undefined: an all-reduce, in place)
  int64_t seq;
  int threads;
  bool timed;
  std::chrono::steady_clock::time_point start;  // its first encode's (the issuing thread's)
  // the issuing thread's token (given back by `end_encodes`) and one per transfer started and
  // not yet decoded (each taken as it is started); the last decides the run (`decided`)
  std::atomic<int64_t> left{1};
  // what its Work waits for: the run decided, and the issuing thread done (`end_encodes`)
  std::atomic<int> parts{2};
  std::atomic<bool> foreign{false};
  std::atomic<bool> nonfinite{false};  // a received message was flagged non-finite
  std::shared_ptr<ServedCounts> counts;  // where its sent bytes are counted
  // with feedback: the key its error states are taken under, the states (for its encodes on
  // the issuing thread, their Python objects let go of with the GIL once put back:
  // `end_encodes`), and its verdict on them, given by `decided` (or, should the run never
  // be, as dropped when it goes)
  std::optional<FeedbackKey> key;
  TakenStates states;
  TakenStates* taken = nullptr;
  std::shared_ptr<RunVerdict> verdict;
  c10::intrusive_ptr<c10::ivalue::Future> previous;  // the place's run before it
  ~Run() {
    if (verdict) {
      verdict->give(true);
    }
    let_go_of_states();  // (a run that never reached `end_encodes`)
  }
  // (an all-reduce on more ranks) a first phase's message did not belong to the call: the
  // messages encoded after it are flagged (plan_core.h's file comment)
  std::atomic<bool> peer_error{false};
  // (a hierarchical run) its issuing thread waits for its rail's decodes (`await_decodes`),
  // each of which signals `decoded` once `awaiting` is set
  std::atomic<bool> awaiting{false};
  std::condition_variable decoded;
  std::atomic<int64_t> encode_ns{0}, decode_ns{0};
  // (a hierarchical run) the time its rail's decodes took in Python, within the run: neither
  // its codec's (the Python plan counts its own codec seconds) nor its wire's
  int64_t python_ns = 0;
  SentBytes sent;  // (the issuing thread's: every transfer is started there)
  std::mutex mutex;
  std::exception_ptr first_error;
  c10::intrusive_ptr<c10::ivalue::Future> result;
};

}  // namespace lowbitcc
