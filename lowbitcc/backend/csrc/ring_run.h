// A ring schedule's run of a plan core (plan_core.h's `PlanCore`: its members here are declared
// there): lowbitcc/schedules/ring.py, any number of ranks, in chunks or not; the run's `Ring`
// (plan_pieces.h). Whole in the issuing thread (plan_core.h: the calling thread, or the group's
// issue lane), in the schedule's order: per step and chunk, what arrived from the left decoded
// and added to the rank's own values of that segment (step 0: the values themselves), encoded
// and sent to the right; then each chunk's own row summed (a reduce-scatter's result), and an
// all-reduce's reduced rows encoded and forwarded around the ring unchanged, then decoded into
// the source. Included by plan_core.h after the class.
#pragma once

#include "plan_core.h"

namespace lowbitcc {

// One row's encode of `spec["ring"]` (whole_runs.py's `ring`): its messages into a `Piece`
// of columns `a .. b` of row `row0`, framed as shard `shard`.
inline Piece PlanCore::read_row_encode(py::dict e, int64_t row0, int64_t a, int64_t b,
                                       int64_t shard, const Piece& chunk) {
  Encode encode{row0, 1, e["messages"].cast<at::Tensor>(), e["nonfinite"].cast<at::Tensor>(),
                {shard}, 0};
  if (feedback_) {
    encode.slot = feedback_->add(e["stage"].cast<std::string>(),
                                 e["state_numel"].cast<int64_t>());
  }
  TORCH_CHECK(encode.messages.is_contiguous() && encode.messages.dim() == 2 &&
                  encode.messages.size(0) == 1 && encode.nonfinite.is_contiguous(),
              "lowbitcc: a ring plan core's buffers do not fit its call");
  Piece piece{row0, 1, a, b, chunk.used, {}, encode.messages, at::Tensor(), chunk.header,
              {}, {}, {}, 0};
  piece.encodes.push_back(std::move(encode));
  return piece;
}

// `spec["ring"]` (whole_runs.py's `ring`) as the run's `Ring`, its buffers checked.
inline Ring PlanCore::read_ring(py::dict t) {
  Ring ring;
  ring.left = (rank_ + world_ - 1) % world_;
  ring.right = (rank_ + 1) % world_;
  int64_t widest = 0;
  for (auto item : t["chunks"]) {
    py::dict c = item.cast<py::dict>();
    Piece chunk{0, 1, c["a"].cast<int64_t>(), c["b"].cast<int64_t>(), c["used"].cast<int64_t>(),
                {}, {}, {}, c["header"].cast<std::string>(), {}, {}, {}, 0};
    TORCH_CHECK((int64_t)chunk.header.size() == loco::kHeaderBytes,
                "lowbitcc: a ring plan core's header does not fit");
    widest = std::max(widest, chunk.b - chunk.a);
    ring.chunks.push_back(std::move(chunk));
  }
  const auto count = static_cast<int64_t>(ring.chunks.size());
  py::list steps = t["steps"], arrived = t["arrived"];
  for (int64_t s = 0; s < world_ - 1; ++s) {
    const int64_t segment = (rank_ - s - 1 + 2 * world_) % world_;
    std::vector<Piece> row;
    std::vector<at::Tensor> into;
    for (int64_t k = 0; k < count; ++k) {
      const Piece& chunk = ring.chunks[k];
      py::dict e = steps[s].cast<py::list>()[k].cast<py::dict>();
      row.push_back(s == 0 ? read_row_encode(e, segment, chunk.a, chunk.b, segment, chunk)
                           : read_row_encode(e, 0, 0, chunk.b - chunk.a, segment, chunk));
      into.push_back(arrived[s].cast<py::list>()[k].cast<at::Tensor>());
      TORCH_CHECK(into.back().is_contiguous() &&
                      into.back().numel() == row.back().sent.size(1),
                  "lowbitcc: a ring plan core's buffers do not fit its call");
    }
    ring.steps.push_back(std::move(row));
    ring.arrived.push_back(std::move(into));
  }
  ring.partial = t["partial"].cast<at::Tensor>();
  ring.own = t["own"].cast<at::Tensor>();
  ring.reduced = t["reduced"].cast<at::Tensor>();
  TORCH_CHECK(ring.partial.numel() >= widest && ring.own.numel() >= widest &&
                  ring.reduced.numel() == m_ && ring.partial.scalar_type() == at::kFloat &&
                  ring.own.scalar_type() == at::kFloat &&
                  ring.reduced.scalar_type() == at::kFloat,
              "lowbitcc: a ring plan core's buffers do not fit its call");
  if (!scatter_) {
    py::list gathers = t["gathers"];
    for (int64_t k = 0; k < count; ++k) {
      const Piece& chunk = ring.chunks[k];
      py::dict g = gathers[k].cast<py::dict>();
      at::Tensor gathered = g["gathered"].cast<at::Tensor>();
      TORCH_CHECK(gathered.is_contiguous() && gathered.dim() == 2 &&
                      gathered.size(0) == world_,
                  "lowbitcc: a ring plan core's buffers do not fit its call");
      py::dict e;
      e["messages"] = gathered.slice(0, rank_, rank_ + 1);
      e["nonfinite"] = g["nonfinite"];
      e["stage"] = g["stage"];
      e["state_numel"] = g["state_numel"];
      ring.gathers.push_back(read_row_encode(e, 0, 0, chunk.b - chunk.a, rank_, chunk));
      Piece spread{0, world_, chunk.a, chunk.b, chunk.used, {}, gathered, at::Tensor(),
                   chunk.header, gathered.slice(0, rank_, rank_ + 1), at::Tensor(),
                   gathered.view({-1}), 0};
      ring.spreads.push_back(std::move(spread));
    }
  }
  return ring;
}

// A ring schedule's run (the file's comment; `ring._reduce_scatter_chunks`, then
// `ring.all_reduce`'s all-gather), whole in the issuing thread without the GIL; a transfer's
// error ends it once every transfer it started is done (`await_all`).
inline void PlanCore::run_ring(Run& run, const at::Tensor& sums) {
  Ring& ring = *ring_;
  const auto count = static_cast<int64_t>(ring.chunks.size());
  std::vector<c10::intrusive_ptr<c10d::Work>> started;
  std::vector<c10::intrusive_ptr<c10d::Work>> inbox(count);
  auto send = [&](const at::Tensor& buffer, int64_t tag) {
    std::vector<at::Tensor> tensors{buffer.view({-1})};
    started.push_back(transport_->send(tensors, static_cast<int>(ring.right),
                                       static_cast<int>(tag)));
    sent_to(run, ring.right, buffer.numel());
  };
  auto receive = [&](const at::Tensor& buffer, int64_t tag) {
    std::vector<at::Tensor> tensors{buffer.view({-1})};
    started.push_back(
        transport_->recv(tensors, static_cast<int>(ring.left), static_cast<int>(tag)));
    return started.back();
  };
  try {
    for (int64_t s = 0; s < world_ - 1; ++s) {
      const int64_t segment = (rank_ - s - 1 + 2 * world_) % world_;
      for (int64_t k = 0; k < count; ++k) {
        const Piece& chunk = ring.chunks[k];
        Piece& piece = ring.steps[s][k];
        at::Tensor values;
        if (s > 0) {
          inbox[k]->wait();
          const auto begun = std::chrono::steady_clock::now();
          values = ring.partial.slice(0, 0, chunk.b - chunk.a);
          sum_arrived(ring, ring.arrived[s - 1][k], chunk, segment, values, run);
          run.decode_ns += nanos_since(begun);
        }
        const auto begun = std::chrono::steady_clock::now();
        encode(piece, run, sums, values);
        run.encode_ns += nanos_since(begun);
        send(piece.sent, s * count + k);
        inbox[k] = receive(ring.arrived[s][k], s * count + k);
      }
    }
    const bool straight = scatter_ && run.output.scalar_type() == at::kFloat;
    for (int64_t k = 0; k < count; ++k) {
      const Piece& chunk = ring.chunks[k];
      inbox[k]->wait();
      const auto begun = std::chrono::steady_clock::now();
      at::Tensor total = (straight ? run.output.view({-1}) : ring.reduced)
                             .slice(0, chunk.a, chunk.b);
      sum_arrived(ring, ring.arrived[world_ - 2][k], chunk, rank_, total, run);
      run.decode_ns += nanos_since(begun);
    }
    if (scatter_) {
      if (!straight) {
        run.output.view({-1}).copy_(ring.reduced);
      }
    } else {
      gather_ring(ring, run, sums, send, receive);
    }
  } catch (...) {
    run.failed(std::current_exception());
  }
  await_all(started, run);
}

// A ring all-reduce's all-gather (`ring.all_reduce`): each chunk's reduced row encoded into
// its row of the chunk's `gathered`, the rows forwarded to the right n - 1 times, as they
// arrive, then every row decoded into the source's columns of the chunk.
template <typename Send, typename Receive>
inline void PlanCore::gather_ring(Ring& ring, Run& run, const at::Tensor& sums, Send& send,
                                  Receive& receive) {
  const auto count = static_cast<int64_t>(ring.chunks.size());
  for (int64_t k = 0; k < count; ++k) {
    const auto begun = std::chrono::steady_clock::now();
    const Piece& chunk = ring.chunks[k];
    encode(ring.gathers[k], run, sums, ring.reduced.slice(0, chunk.a, chunk.b));
    run.encode_ns += nanos_since(begun);
  }
  const int64_t base = (world_ - 1) * count;
  std::vector<c10::intrusive_ptr<c10d::Work>> inbox(count);
  for (int64_t s = 0; s < world_ - 1; ++s) {
    const int64_t segment = (rank_ - s + world_) % world_;
    const int64_t next = (rank_ - s - 1 + 2 * world_) % world_;
    for (int64_t k = 0; k < count; ++k) {
      at::Tensor gathered = ring.spreads[k].sent;
      if (s > 0) {
        inbox[k]->wait();
      }
      send(gathered.select(0, segment), base + s * count + k);
      inbox[k] = receive(gathered.select(0, next), base + s * count + k);
    }
  }
  for (int64_t k = 0; k < count; ++k) {
    inbox[k]->wait();
    if (run.foreign) {
      continue;  // (the plan decodes them all again: `decided`)
    }
    const auto begun = std::chrono::steady_clock::now();
    decode_reduced_rows(ring.spreads[k], call_header(ring.chunks[k].header, run.seq), run);
    run.decode_ns += nanos_since(begun);
  }
}

// What arrived (`arrived`, uint8 [P]: shard `shard`'s columns of `chunk`) verified, decoded
// into `target` (fp32 [width]) and the rank's own values of those columns (`chunking.
// row_values`) added: `ring._reduce_scatter_chunks`' partial sums and totals. A message that
// does not belong to the call leaves NaN, the run foreign and its later messages flagged.
inline void PlanCore::sum_arrived(Ring& ring, const at::Tensor& arrived, const Piece& chunk,
                                  int64_t shard,
                                  at::Tensor target, Run& run) {
  const int64_t width = chunk.b - chunk.a;
  sum_messages(arrived.view({1, -1}), width, shard, call_header(chunk.header, run.seq), target,
               run);
  at::Tensor own = ring.own.slice(0, 0, width);
  scaled_values(run, std::min(shard * m_ + chunk.a, numel_),
                std::min(shard * m_ + chunk.b, numel_), own);
  target.add_(own);
}

}  // namespace lowbitcc
