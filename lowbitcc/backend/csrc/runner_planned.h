// A compressed entry's steady run, served by its plan's C++ core (steady_runner.h's
// `SteadyRunner`: its members here are declared there, with what each does). Included by
// steady_runner.h after the class.
#pragma once

#include <optional>
#include <string>

#include "steady_runner.h"

namespace lowbitcc {

inline py::object SteadyRunner::serve_planned(Steady& steady, const py::str& collective,
                                              const at::Tensor& tensor, bool synchronous) {
  ran(steady);
  if (steady.renews && queue_.attr(LOWBITCC_NAME("_pending")).cast<int64_t>() != 0) {
    // the renewal's exchange, on the same gloo group, goes first
    queue_.attr(LOWBITCC_NAME("wait_idle"))();
  }
  const int64_t seq = agreement_.attr(LOWBITCC_NAME("next_seq"))().cast<int64_t>();
  PlanCore& core = *steady.core;
  FeedbackSlots* feedback = core.feedback();
  std::optional<FeedbackKey> key;
  std::optional<std::string> name = count_in_key_block();  // `CompressedCalls.key`
  if (feedback != nullptr && name) {
    key = FeedbackKey{feedback->named(*name), false};
  } else if (feedback != nullptr) {
    const int64_t task = torch::autograd::get_current_graph_task_id();
    key = FeedbackKey{feedback->derived(next_ordinal(collective, tensor, tensor.numel(), task)),
                      true};
  }
  py::object model = compressed_.attr(LOWBITCC_NAME("cost_model"));
  if (steady.modelled) {
    count_class(model, core.size_class());
  }
  at::Tensor sums = accumulator();  // (and the statistics the counts go to: `counted_in`)
  counts_->add(ServedCounts::kCompressed, ServedCounts::kCalls, 1);
  counts_->add(ServedCounts::kCompressed, ServedCounts::kTensorBytes, core.nbytes());
  counts_->add(ServedCounts::kCompressed, ServedCounts::kLogicalBytes, core.logical_bytes());
  RunTimings timings = core.take_timings();
  counts_->add_seconds(ServedCounts::kCompressed, ServedCounts::kCodec, timings.codec_s);
  counts_->add_seconds(ServedCounts::kCompressed, ServedCounts::kWire, timings.wire_s);
  for (double seconds : timings.modelled_s) {
    timings_.add(core.size_class(), false, seconds, core.nbytes());
  }
  timings_.fold(model, false);  // the runs timed before, in batches
  ++served_;
  ++served_compressed_;
  // (its sent bytes counted in `counts_` and its states put back by its issuing thread)
  c10::intrusive_ptr<c10d::Work> work = core.run(tensor, steady.output, seq, sums,
                                                 steady.modelled, counts_, std::move(key),
                                                 lane_.get(), synchronous);
  // (a peer's deviation reaches a compressed call as its messages, not as its output's NaN)
  py::object followed = follow(work, {steady.output.defined() ? steady.output : tensor}, false);
  if (core.keeps_canary()) {  // `reductions._keep_canaries`, then `Entry.keep`
    steady.entry.attr(LOWBITCC_NAME("canary")) = steady.entry.attr(LOWBITCC_NAME("latest"));
    steady.entry.attr(LOWBITCC_NAME("latest")) = followed;
  }
  return followed;
}

inline bool SteadyRunner::named_in_utf8() const {
  const Py_ssize_t blocks = PyList_GET_SIZE(key_stack_.ptr());
  if (blocks == 0) {
    return true;
  }
  PyObject* block = PyList_GET_ITEM(key_stack_.ptr(), blocks - 1);
  PyObject* name = PyList_Check(block) && PyList_GET_SIZE(block) == 2
                       ? PyList_GET_ITEM(block, 0) : nullptr;
  if (name == nullptr || !PyUnicode_Check(name) ||
      PyUnicode_AsUTF8AndSize(name, nullptr) == nullptr) {
    PyErr_Clear();
    return false;
  }
  return true;
}

}  // namespace lowbitcc
