// A tree schedule's run of a plan core (plan_core.h's `PlanCore`: its members here are declared
// there): lowbitcc/schedules/tree.py, an all-reduce or a reduce-scatter of any number of ranks,
// never chunked; the run's `Tree` (plan_pieces.h). Whole in the issuing thread (plan_core.h:
// the calling thread, or the group's issue lane), in the schedule's order: its children's
// messages of every row received, each row's verified and summed (a foreign one: NaN, as the
// Python decode leaves it, and the messages encoded after it flagged), added to its own values,
// encoded and sent to its parent (a leaf encodes its own values), the root's codes received from
// the parent and sent on to its children, then decoded: every row into the source (an
// all-reduce, cast), or its own row into the output.
// Included by plan_core.h after the class.
#pragma once

#include "plan_core.h"

namespace lowbitcc {

// `spec["tree"]` (whole_runs.py's `tree`) as the run's `Tree`, its buffers checked.
inline Tree PlanCore::read_tree(py::dict t) {
  Tree tree;
  tree.children = t["children"].cast<std::vector<int64_t>>();
  tree.parent = t["parent"].cast<int64_t>();
  Encode encode{0, world_, t["messages"].cast<at::Tensor>(), t["nonfinite"].cast<at::Tensor>(),
                {}, 0};
  if (feedback_) {
    encode.slot = feedback_->add(t["stage"].cast<std::string>(),
                                 t["state_numel"].cast<int64_t>());
  }
  for (int64_t r = 0; r < world_; ++r) {
    encode.shards.push_back(r);
  }
  const int64_t P = encode.messages.size(1);
  const auto kids = static_cast<int64_t>(tree.children.size());
  bool fit = encode.messages.is_contiguous() && encode.messages.size(0) == world_ &&
             encode.nonfinite.is_contiguous() && scratch_.numel() >= m_;
  if (kids > 0) {
    tree.partial = t["partial"].cast<at::Tensor>();
    tree.from_children = t["from_children"].cast<at::Tensor>();
    fit = fit && tree.partial.is_contiguous() && tree.partial.scalar_type() == at::kFloat &&
          tree.partial.numel() == world_ * m_ && tree.from_children.is_contiguous() &&
          tree.from_children.sizes() == at::IntArrayRef({kids, world_, P});
  }
  if (tree.parent >= 0) {
    tree.from_parent = t["from_parent"].cast<at::Tensor>();
    fit = fit && tree.from_parent.is_contiguous() &&
          tree.from_parent.sizes() == at::IntArrayRef({world_, P});
  }
  tree.piece = Piece{0, world_, 0, m_, t["used"].cast<int64_t>(), {}, encode.messages,
                     at::Tensor(), t["header"].cast<std::string>(), {}, {}, {}, 0};
  tree.piece.encodes.push_back(std::move(encode));
  TORCH_CHECK(fit && (int64_t)tree.piece.header.size() == loco::kHeaderBytes,
              "lowbitcc: a tree plan core's buffers do not fit its call");
  return tree;
}

// A tree schedule's run (the file's comment; `tree._reduce_and_broadcast`, then the
// decode), whole in the issuing thread without the GIL; a transfer's error ends it once every
// transfer it started is done (`await_all`).
inline void PlanCore::run_tree(Run& run, const at::Tensor& sums) {
  Tree& tree = *tree_;
  std::vector<c10::intrusive_ptr<c10d::Work>> started;
  auto transfer = [&](bool send, const at::Tensor& buffer, int64_t peer, int tag) {
    std::vector<at::Tensor> tensors{buffer.view({-1})};
    started.push_back(send ? transport_->send(tensors, static_cast<int>(peer), tag)
                           : transport_->recv(tensors, static_cast<int>(peer), tag));
    if (send) {
      sent_to(run, peer, buffer.numel());
    }
    return started.back();
  };
  try {
    std::vector<c10::intrusive_ptr<c10d::Work>> inbox;
    for (size_t i = 0; i < tree.children.size(); ++i) {
      inbox.push_back(transfer(false, tree.from_children[i], tree.children[i], kUp));
    }
    for (auto& work : inbox) {
      work->wait();
    }
    at::Tensor codes = tree.piece.sent;
    std::string header;
    auto begun = std::chrono::steady_clock::now();
    if (!tree.children.empty()) {
      header = call_header(tree.piece.header, run.seq);
      sum_children(tree, header, run);
      const auto summed = std::chrono::steady_clock::now();
      run.decode_ns += nanos_between(begun, summed);
      begun = summed;
    }
    header = encode(tree.piece, run, sums, tree.partial);
    run.encode_ns += nanos_since(begun);
    if (tree.parent >= 0) {
      transfer(true, codes, tree.parent, kUp);
      transfer(false, tree.from_parent, tree.parent, kDown)->wait();
      codes = tree.from_parent;
    }
    for (int64_t child : tree.children) {
      transfer(true, codes, child, kDown);
    }
    begun = std::chrono::steady_clock::now();
    decode_codes(codes, header, run);
    run.decode_ns += nanos_since(begun);
  } catch (...) {
    run.failed(std::current_exception());
  }
  await_all(started, run);
}

// A tree's partial sums: its values times the op's factor (`chunking.all_values`), each row's
// children's messages verified and summed in child order, then added (a row whose messages do
// not belong to the call: NaN, the run foreign and its later messages flagged).
inline void PlanCore::sum_children(Tree& tree, const std::string& header, Run& run) {
  std::lock_guard<std::mutex> lock(scratch_mutex_);
  scaled_values(run, 0, numel_, tree.partial);
  at::Tensor scratch = scratch_.slice(0, 0, m_);
  for (int64_t j = 0; j < world_; ++j) {
    sum_messages(tree.from_children.select(1, j), m_, j, header, scratch, run);
    tree.partial.slice(0, j * m_, (j + 1) * m_).add_(scratch);
  }
}

// A tree's last decode of the root's `codes` (uint8 [world, P]): every row into the source
// (an all-reduce, cast) or this rank's into the output; codes that do not belong to the call
// mark the run foreign, for `decided`.
inline void PlanCore::decode_codes(const at::Tensor& codes, const std::string& header, Run& run) {
  at::Tensor messages = scatter_ ? codes.slice(0, rank_, rank_ + 1) : codes;
  std::vector<int64_t> shards;
  for (int64_t r = scatter_ ? rank_ : 0; r < (scatter_ ? rank_ + 1 : world_); ++r) {
    shards.push_back(r);
  }
  const int64_t verdict = api_->verify(messages, header, shards, checksum_, step_, run.threads);
  received(run, verdict);
  if (verdict < 0) {
    run.foreign = true;
  } else if (scatter_) {
    sum_into(messages, m_, run.output.view({-1}), run.threads);
  } else {
    api_->decode_into(messages, m_, bits_, group_size_, format_, run.flat, run.threads);
  }
}

}  // namespace lowbitcc
