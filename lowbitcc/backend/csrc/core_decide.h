// A plan core's decodes and a run's end (plan_core.h's `PlanCore`: its members here are declared
// there): received messages verified and summed in rank order (the Python path's own check asked
// where `verify` refuses one), then, every transfer decoded, the run decided: its seconds
// counted, a foreign message handed to the Python plan, the verdict on its error states given,
// and its Work completed. Included by plan_core.h after the class.
#pragma once

#include "plan_core.h"

namespace lowbitcc {

// The fp32 sum in rank order of `messages` (uint8 [n, P], every one shard `shard`'s `width`
// columns under `header`) into `target` (fp32 [width]): where `verify` and then the Python
// path's own check (`accepts`) refuse them, NaN, the run foreign and the messages it encodes
// after flagged, as the Python decode leaves them (`CallCompressor._deferred`).
inline void PlanCore::sum_messages(const at::Tensor& messages, int64_t width, int64_t shard,
                                   const std::string& header, at::Tensor target, Run& run) {
  const int64_t verdict =
      api_->verify(messages, header, std::vector<int64_t>(messages.size(0), shard), checksum_,
                   step_, run.threads);
  if (verdict < 0 && !accepts(messages, width, shard, run.seq)) {
    run.foreign = true;
    run.peer_error = true;
    target.fill_(std::numeric_limits<float>::quiet_NaN());
    return;
  }
  received(run, verdict);
  api_->decode_sum(messages, width, bits_, group_size_, format_, run.threads, target);
}

// Whether `messages` of shard `shard` and `width` columns that `verify` refused pass the Python
// path's own check after all (`CallPlan.accepts`, with the GIL: the field-by-field check lets
// through what `verify`'s whole-header comparison does not, e.g. an unknown flag bit), so that
// the sum is what the Python path's is. On the issuing thread, without the GIL.
inline bool PlanCore::accepts(const at::Tensor& messages, int64_t width, int64_t shard,
                              int64_t seq) {
  if (!python_running()) {
    return false;
  }
  py::gil_scoped_acquire acquire;
  py::object plan = plan_();
  return !plan.is_none() && plan.attr("accepts")(messages, width, shard, seq).cast<bool>();
}

// The fp32 sum in rank order of `messages` of `width` columns into `target`: straight where
// it is fp32 and as wide, else through the scratch (one decode at a time) and a cast.
inline void PlanCore::sum_into(const at::Tensor& messages, int64_t width, at::Tensor target,
                               int threads) {
  if (target.scalar_type() == at::kFloat && target.numel() == width) {
    api_->decode_sum(messages, width, bits_, group_size_, format_, threads, target);
    return;
  }
  std::lock_guard<std::mutex> lock(scratch_mutex_);
  at::Tensor scratch = scratch_.slice(0, 0, width);
  api_->decode_sum(messages, width, bits_, group_size_, format_, threads, scratch);
  target.copy_(scratch.slice(0, 0, target.numel()));
}

// `run` decided, every transfer decoded (on the thread of the last, or the issuing thread):
// a transfer's error is the run's; a foreign message hands the decode to the Python plan,
// which raises what the call met (plan_core.h's file comment); the verdict on its states given;
// then its part of the run is done (`complete`).
inline void PlanCore::decided(Run& run) {
  const auto end = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const double codec_s = (run.encode_ns.load() + run.decode_ns.load()) * 1e-9;
    timings_.codec_s += codec_s;
    timings_.wire_s += seconds(run.start, end) - codec_s - run.python_ns * 1e-9;
    if (run.timed) {
      timings_.modelled_s.push_back(seconds(run.start, end));
    }
  }
  // the verdict on its states (put back by now, or about to be: feedback_slots.h): dropped
  // where a decode met a non-finite value, a transfer failed, or a message `verify` refused is
  // one the Python plan's decodes, which then redo them, meet as foreign or non-finite too
  // (its field check accepts some that `verify` does not: those keep the states, as on the
  // Python path)
  const bool failed = run.has_error();
  bool dropped = run.nonfinite || run.foreign || failed;
  if (!failed && run.foreign) {
    try {
      dropped = run.nonfinite || finish_in_python(run);
    } catch (...) {
      run.failed(std::current_exception());
    }
  }
  if (run.verdict) {
    run.verdict->give(dropped);
  }
  if (--run.parts == 0) {
    complete(run);
  }
}

// The Python plan's decodes of what `run` received (`CallPlan.finish_received`, with the GIL),
// where a message did not belong to the call by the C++ check: they write what the Python
// path's decodes write and raise what the call met; whether they met a non-finite value.
// Throws what they raise, or a `std::runtime_error` where the interpreter is exiting or the
// plan is gone.
inline bool PlanCore::finish_in_python(const Run& run) {
  if (!python_running()) {
    throw std::runtime_error("lowbitcc: a call met a foreign message as the interpreter exited");
  }
  py::gil_scoped_acquire acquire;
  py::object plan = plan_();
  if (plan.is_none()) {
    throw std::runtime_error("lowbitcc: a call met a foreign message after its plan was gone");
  }
  return plan.attr("finish_received")(
      run.tensor, run.seq, run.output.defined() ? py::cast(run.output) : py::none())
      .cast<bool>();
}

// The end of `run`, decided and its issuing thread done (the last of the two, on its thread):
// its error, else its outputs, complete its future (its Work).
inline void PlanCore::complete(Run& run) {
  if (run.first_error) {
    run.result->setError(run.first_error);
  } else {
    run.result->markCompleted(c10::IValue(
        std::vector<at::Tensor>{run.output.defined() ? run.output : run.tensor}));
  }
}

}  // namespace lowbitcc
