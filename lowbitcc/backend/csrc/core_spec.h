// A plan core made from its plan's spec (plan_core.h's `PlanCore`: its constructor, declared
// there): lowbitcc/backend/plan_cores.py's `core_spec` read into the core's settings, its
// transfers' pieces (each encode's buffers and shards) and, where the plan runs another schedule
// than the direct one, that schedule's run (`read_tree`, `read_ring`, `read_hier`), each
// buffer checked to fit the call. Included by plan_core.h after the class.
#pragma once

#include "plan_core.h"

namespace lowbitcc {

inline PlanCore::PlanCore(py::object transport, py::dict spec, py::capsule api, py::object park)
    : transport_(transport.cast<c10::intrusive_ptr<c10d::Backend>>()),
      transport_object_(std::move(transport)),
      park_(std::move(park)),
      plan_(py::weakref(spec["plan"])),
      size_class_(spec["size_class"]),
      scratch_(spec["scratch"].cast<at::Tensor>()),
      dtype_(reinterpret_cast<THPDtype*>(spec["dtype"].ptr())->scalar_type),
      scatter_(spec["collective"].cast<std::string>() == "reduce_scatter"),
      two_phase_(!scatter_ && spec["world"].cast<int64_t>() > 2),
      numel_(spec["numel"].cast<int64_t>()),
      m_(spec["m"].cast<int64_t>()),
      world_(spec["world"].cast<int64_t>()),
      rank_(spec["rank"].cast<int64_t>()),
      bits_(spec["bits"].cast<int64_t>()),
      group_size_(spec["group_size"].cast<int64_t>()),
      format_(spec["format"].cast<int64_t>()),
      step_(spec["step"].cast<int64_t>()),
      seq_offset_(spec["seq_offset"].cast<int64_t>()),
      flags_offset_(spec["flags_offset"].cast<int64_t>()),
      peer_error_flag_(spec["peer_error_flag"].cast<uint8_t>()),
      factor_(spec["factor"].cast<double>()),
      beta_(spec["beta"].cast<double>()),
      checksum_(spec["checksum"].cast<bool>()),
      modelled_(spec["modelled"].cast<bool>()),
      nbytes_(spec["nbytes"].cast<int64_t>()),
      logical_bytes_(spec["logical_bytes"].cast<int64_t>()),
      same_node_(spec["same_node"].cast<std::vector<bool>>()) {
  for (int64_t r = 0; r < static_cast<int64_t>(same_node_.size()); ++r) {
    if (r != rank_) {
      ++(same_node_[r] ? peers_inside_ : peers_across_);
    }
  }
  api_ = static_cast<const lowbitcc_cpu::CodecApi*>(
      PyCapsule_GetPointer(api.ptr(), lowbitcc_cpu::kCodecApiName));
  if (api_ == nullptr) {
    throw py::error_already_set();
  }
  TORCH_CHECK(api_->version == lowbitcc_cpu::kCodecApiVersion, "lowbitcc: the C++ codec's API ",
              api_->version, " is not the runner's ", lowbitcc_cpu::kCodecApiVersion);
  TORCH_CHECK((world_ >= 2 || scatter_) && scratch_.scalar_type() == at::kFloat,
              "lowbitcc: a plan core runs a reduce-scatter, or an all-reduce of 2 ranks or more");
  if (!spec["feedback"].is_none()) {
    feedback_ = std::make_unique<FeedbackSlots>(spec["feedback"].cast<py::dict>(), group_size_);
  }
  call_dtype_ = dtype_;
  call_numel_ = numel_;
  if (!spec["hier"].is_none()) {  // (then its pieces are its rail's, below)
    hier_ = read_hier(spec["hier"].cast<py::dict>());
    call_dtype_ = hier_->dtype;
    call_numel_ = hier_->numel;
  }
  if (!spec["ring"].is_none()) {
    ring_ = read_ring(spec["ring"].cast<py::dict>());
    if (feedback_) {
      std::vector<size_t> order;
      for (const auto& step : ring_->steps) {
        for (const Piece& piece : step) {
          order.push_back(piece.encodes[0].slot);
        }
      }
      for (const Piece& piece : ring_->gathers) {
        order.push_back(piece.encodes[0].slot);
      }
      feedback_->set_order(order);
    }
    return;
  }
  if (!spec["tree"].is_none()) {
    tree_ = read_tree(spec["tree"].cast<py::dict>());
    if (feedback_) {
      feedback_->set_order({tree_->piece.encodes[0].slot});
    }
    return;
  }
  for (auto item : spec["pieces"]) {
    py::dict p = item.cast<py::dict>();
    Piece piece{p["row0"].cast<int64_t>(), p["rows"].cast<int64_t>(), p["a"].cast<int64_t>(),
                p["b"].cast<int64_t>(), p["used"].cast<int64_t>(), {},
                p["sent"].cast<at::Tensor>(), p["received"].cast<at::Tensor>(),
                p["header"].cast<std::string>(), {}, {}, {}, 0};
    const int64_t P = piece.sent.size(1);
    const bool to_all = scatter_ || two_phase_;  // the first phase is an all-to-all
    bool fit = (int64_t)piece.header.size() == loco::kHeaderBytes &&
               piece.sent.is_contiguous() && piece.sent.size(0) == piece.rows &&
               piece.received.numel() ==
                   (to_all ? piece.sent.numel() : world_ * piece.sent.numel()) &&
               (!to_all || (piece.row0 == 0 && piece.rows == world_)) &&
               scratch_.numel() >= piece.b - piece.a;
    if (two_phase_) {
      piece.again = p["again"].cast<at::Tensor>();
      piece.again_nonfinite = p["again_nonfinite"].cast<at::Tensor>();
      piece.again_received = p["again_received"].cast<at::Tensor>();
      if (feedback_) {
        piece.again_slot = feedback_->add(p["again_stage"].cast<std::string>(),
                                          p["again_state_numel"].cast<int64_t>());
      }
      fit = fit && piece.again.is_contiguous() && piece.again.size(0) == 1 &&
            piece.again.size(1) == P && piece.again_nonfinite.is_contiguous() &&
            piece.again_received.numel() == world_ * P &&
            piece.again_received.is_contiguous();
    }
    for (auto unit : p["encodes"]) {
      py::dict e = unit.cast<py::dict>();
      Encode encode{e["row0"].cast<int64_t>(), e["rows"].cast<int64_t>(),
                    e["messages"].cast<at::Tensor>(), e["nonfinite"].cast<at::Tensor>(), {}, 0};
      if (feedback_) {
        encode.slot = feedback_->add(e["stage"].cast<std::string>(),
                                     e["state_numel"].cast<int64_t>());
      }
      for (int64_t r = encode.row0; r < encode.row0 + encode.rows; ++r) {
        encode.shards.push_back(r);
      }
      fit = fit && encode.messages.is_contiguous() && encode.messages.size(0) == encode.rows &&
            encode.messages.size(1) == P &&
            (encode.rows == 1 || (encode.row0 == 0 && piece.a == 0 && piece.b == m_));
      piece.encodes.push_back(std::move(encode));
    }
    TORCH_CHECK(fit && !piece.encodes.empty(),
                "lowbitcc: a plan core's buffers do not fit its call");
    pieces_.push_back(std::move(piece));
  }
  if (feedback_) {
    feedback_->set_order(encode_order());
  }
}

}  // namespace lowbitcc
