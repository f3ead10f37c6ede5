// A plan core's encodes (plan_core.h's `PlanCore`: its members here are declared there): each
// piece's encodes and frames from the call's source into its messages, with the run's error
// states where feedback is on (feedback_slots.h), in the order the Python schedule encodes;
// what a run's encodes and `verify` found; the flag on messages encoded after a foreign one.
// Included by plan_core.h after the class.
#pragma once

#include "plan_core.h"

namespace lowbitcc {

// The encodes and frames of `piece` of `run` (as `chunking.encode_columns` / `encode_row`:
// each encode's rows' columns where they lie in the flat source, zero past its end); its
// header. `values`: fp32 values encoded in the source's place, unscaled (a tree's partial
// sums; undefined: the source, times the op's factor).
inline std::string PlanCore::encode(Piece& piece, Run& run, const at::Tensor& sums,
                                   const at::Tensor& values) {
  const std::string header = call_header(piece.header, run.seq);
  const int64_t m = piece.b - piece.a;
  const at::Tensor& flat = values.defined() ? values : run.flat;
  const int64_t numel = flat.numel();
  const double factor = values.defined() ? 1.0 : factor_;
  for (Encode& unit : piece.encodes) {
    const int64_t lo = std::min(unit.row0 * m_ + piece.a, numel);
    const int64_t hi = unit.rows == 1 ? std::min(unit.row0 * m_ + piece.b, numel) : numel;
    loco::EncodeArgs a{};
    a.src = static_cast<const char*>(flat.data_ptr()) + lo * flat.element_size();
    a.msgs = unit.messages.data_ptr<uint8_t>();
    a.nonfinite = unit.nonfinite.data_ptr<uint8_t>();
    a.sums = sums.data_ptr<double>();
    a.numel = hi - lo;
    a.rows = unit.rows;
    a.m = m;
    a.ng = (m + group_size_ - 1) / group_size_;
    a.P = unit.messages.size(1);
    a.factor = static_cast<float>(factor);
    a.scale_input = factor != 1.0;
    a.beta = static_cast<float>(beta_);
    a.omb = static_cast<float>(1.0 - beta_);
    a.G = static_cast<int32_t>(group_size_);
    a.format = static_cast<int32_t>(format_);
    apply_state(a, run, unit.slot);
    api_->encode(a, bits_, run.threads, values.defined() ? at::kFloat : dtype_);
    encoded(run, api_->frame(unit.messages, header, unit.shards, unit.nonfinite, piece.used, 0,
                             checksum_, step_, run.threads));
    if (run.peer_error) {
      flag_peer_error(unit.messages);
    }
  }
  return header;
}

// The error state slots in the order a run's encodes run: each transfer's in turn; on more
// ranks chunk k's second phase after chunk k + 1's first (`run_two_phases`, as
// `direct._in_pipeline_order`).
inline std::vector<size_t> PlanCore::encode_order() const {
  std::vector<size_t> order;
  for (size_t k = 0; k < pieces_.size(); ++k) {
    for (const Encode& unit : pieces_[k].encodes) {
      order.push_back(unit.slot);
    }
    if (two_phase_ && k >= 1) {
      order.push_back(pieces_[k - 1].again_slot);
    }
  }
  if (two_phase_) {
    order.push_back(pieces_.back().again_slot);
  }
  return order;
}

// An encode's error state, `run`'s slot `slot` (feedback_slots.h), in `a`: applied or written
// from zero, in the plan's storage; none where feedback is off. The encode is counted (the
// encodes run in `encode_order`'s order).
inline void PlanCore::apply_state(loco::EncodeArgs& a, Run& run, size_t slot) const {
  a.mode = loco::kErrorNone;
  if (run.taken == nullptr) {
    return;
  }
  Slot& state = run.taken->slots[slot];
  a.mode = feedback_->mode();
  a.has_error = state.applied;
  if (a.mode == loco::kErrorInt8) {
    a.ecodes = state.data.data_ptr<int8_t>();
    a.escales = state.scales.data_ptr<float>();
  } else if (a.mode == loco::kErrorFp32) {
    a.ef32 = state.data.data_ptr<float>();
  } else {
    a.ebf16 = reinterpret_cast<uint16_t*>(state.data.data_ptr<at::BFloat16>());
  }
  TORCH_CHECK(feedback_->in_order(run.taken->encoded++, slot),
              "lowbitcc: a plan core's encodes ran out of their order");
}

// An encode of `run` was framed; `nonfinite`: it met a non-finite value (its states are then
// not put back: `FeedbackSlots::put`).
inline void PlanCore::encoded(Run& run, bool nonfinite) {
  if (nonfinite && run.taken != nullptr) {
    run.taken->encoded_nonfinite = true;
  }
}

// What `verify` found of messages `run` received (1: a row flagged non-finite).
inline void PlanCore::received(Run& run, int64_t verdict) {
  if (verdict > 0) {
    run.nonfinite = true;
  }
}

// `CallCompressor.encode`'s flag on messages (uint8 [rows, P]) encoded after a message of the
// call did not belong to it.
inline void PlanCore::flag_peer_error(const at::Tensor& messages) const {
  uint8_t* bytes = messages.data_ptr<uint8_t>();
  const int64_t P = messages.size(1);
  for (int64_t r = 0; r < messages.size(0); ++r) {
    bytes[r * P + flags_offset_] |= peer_error_flag_;
  }
}

// The source's elements `lo .. hi` in fp32 `into`, zero past them, times the op's factor
// (`chunking.all_values` / `row_values`).
inline void PlanCore::scaled_values(const Run& run, int64_t lo, int64_t hi,
                                    at::Tensor into) const {
  into.slice(0, 0, hi - lo).copy_(run.flat.slice(0, lo, hi));
  if (hi - lo < into.numel()) {
    into.slice(0, hi - lo).zero_();
  }
  if (factor_ != 1.0) {
    into.mul_(factor_);
  }
}

}  // namespace lowbitcc
