// The direct schedule's runs of a plan core (plan_core.h's `PlanCore`: its members here are
// declared there), and their decodes: lowbitcc/schedules/direct.py. `run_pieces`, on the calling
// thread: each transfer's encodes and its all-gather (two ranks' all-reduce) or all-to-all (a
// reduce-scatter) started, its decode on the thread gloo completes it on (`decode_when_done`:
// `decode_rows`, `decode_own_row`); `run_two_phases`, an all-reduce's on more ranks, whole on its
// issuing thread: the first phase's all-to-alls, each chunk's reduced row encoded and
// all-gathered (`gather`) as its all-to-all completes, the all-gathers decoded on gloo's threads
// (`decode_reduced_rows`). The file comment of plan_core.h says what each writes. Included by
// plan_core.h after the class.
#pragma once

#include "plan_core.h"

namespace lowbitcc {

// A run of the direct schedule's pieces (not an all-reduce's two phases) on the calling
// thread without the GIL: each piece encoded and its transfer started, its decode on gloo's
// thread (`decode_when_done`).
inline void PlanCore::run_pieces(const std::shared_ptr<PlanCore>& self,
                                 const std::shared_ptr<Run>& run, const at::Tensor& sums) {
  for (size_t k = 0; k < pieces_.size(); ++k) {
    Piece& piece = pieces_[k];
    const auto begun = std::chrono::steady_clock::now();
    auto encoded = begun;
    std::string header;
    c10::intrusive_ptr<c10d::Work> transfer;
    try {
      header = encode(piece, *run, sums);
      encoded = std::chrono::steady_clock::now();
      at::Tensor message = piece.sent.view({-1});
      if (scatter_) {
        std::vector<int64_t> equal;  // (empty: equal splits, as `all_to_all_async`)
        c10d::AllToAllOptions options;
        transfer = transport_->alltoall_base(piece.received, message, equal, equal, options);
        sent_to_peers(*run, piece.sent.size(1));  // a row to each
      } else {
        c10d::AllgatherOptions options;
        transfer = transport_->_allgather_base(piece.received, message, options);
        sent_to_peers(*run, message.numel());
      }
    } catch (...) {
      // no transfer from here on: the run ends with this error once those started are done
      run->failed(std::current_exception());
      break;
    }
    run->encode_ns += nanos_between(begun, encoded);
    ++run->left;  // (started: its callback gives it back)
    decode_when_done(self, transfer, run, k, header);
  }
}

// An all-reduce on more ranks, in the issuing thread without the GIL (the file's comment):
// the first phase in `direct._pipeline`'s order, each chunk's second phase started as its
// first completes.
inline void PlanCore::run_two_phases(const std::shared_ptr<PlanCore>& self,
                                     const std::shared_ptr<Run>& run, const at::Tensor& sums) {
  std::deque<std::pair<size_t, c10::intrusive_ptr<c10d::Work>>> scattering;
  std::vector<std::string> headers(pieces_.size());
  bool ok = true;
  auto reduce_oldest = [&]() {
    auto [k, transfer] = std::move(scattering.front());
    scattering.pop_front();
    auto done = transfer->getFuture();
    done->wait();
    if (!ok) {
      return;  // (a transfer before failed: the ones after it are only awaited)
    }
    if (done->hasError()) {
      run->failed(done->exception_ptr());
      ok = false;
      return;
    }
    try {
      gather(self, run, k, headers[k], sums);
    } catch (...) {
      run->failed(std::current_exception());
      ok = false;
    }
  };
  for (size_t k = 0; k < pieces_.size() && ok; ++k) {
    Piece& piece = pieces_[k];
    const auto begun = std::chrono::steady_clock::now();
    try {
      headers[k] = encode(piece, *run, sums);
    } catch (...) {
      run->failed(std::current_exception());
      ok = false;
      break;
    }
    run->encode_ns += nanos_since(begun);
    std::vector<int64_t> equal;  // (empty: equal splits, as `GlooTransport.all_to_all_async`)
    c10d::AllToAllOptions options;
    at::Tensor sent = piece.sent.view({-1});
    try {
      scattering.emplace_back(
          k, transport_->alltoall_base(piece.received, sent, equal, equal, options));
      sent_to_peers(*run, piece.sent.size(1));
    } catch (...) {
      run->failed(std::current_exception());
      ok = false;
      break;
    }
    if (scattering.size() > 1) {
      reduce_oldest();
    }
  }
  while (!scattering.empty()) {
    reduce_oldest();
  }
}

// Chunk `k`'s second phase (on the issuing thread, its all-to-all complete): the messages of
// this rank's row verified and summed in rank order into the scratch (NaN where one does not
// belong to the call: the run is then foreign, and its later messages flagged), the sum
// encoded into `again` and all-gathered; its decode on gloo's thread.
inline void PlanCore::gather(const std::shared_ptr<PlanCore>& self,
                             const std::shared_ptr<Run>& run, size_t k, const std::string& header,
                             const at::Tensor& sums) {
  Piece& piece = pieces_[k];
  const auto begun = std::chrono::steady_clock::now();
  const int64_t width = piece.b - piece.a, P = piece.sent.size(1);
  at::Tensor reduced = scratch_.slice(0, 0, width);
  at::Tensor messages = piece.received.view({world_, P});
  sum_messages(messages, width, rank_, header, reduced, *run);
  loco::EncodeArgs a{};
  a.src = reduced.data_ptr();
  a.msgs = piece.again.data_ptr<uint8_t>();
  a.nonfinite = piece.again_nonfinite.data_ptr<uint8_t>();
  a.sums = sums.data_ptr<double>();
  a.numel = width;
  a.rows = 1;
  a.m = width;
  a.ng = (width + group_size_ - 1) / group_size_;
  a.P = P;
  a.factor = 1.0f;
  a.scale_input = false;
  a.beta = static_cast<float>(beta_);
  a.omb = static_cast<float>(1.0 - beta_);
  a.G = static_cast<int32_t>(group_size_);
  a.format = static_cast<int32_t>(format_);
  apply_state(a, *run, piece.again_slot);
  api_->encode(a, bits_, run->threads, at::kFloat);
  encoded(*run, api_->frame(piece.again, header, {rank_}, piece.again_nonfinite, piece.used, 0,
                            checksum_, step_, run->threads));
  if (run->peer_error) {
    flag_peer_error(piece.again);
  }
  run->encode_ns += nanos_since(begun);
  c10d::AllgatherOptions options;
  at::Tensor sent = piece.again.view({-1});
  auto transfer = transport_->_allgather_base(piece.again_received, sent, options);
  sent_to_peers(*run, sent.numel());
  ++run->left;  // (started: its callback gives it back)
  decode_when_done(self, transfer, run, k, header);
}

// When `transfer`, piece `k`'s of `run` (its messages' header `header`), completes, on the
// thread gloo completes it on: its error is the run's, else its decode (the core's kind's:
// a two ranks' all-reduce's rows, a reduce-scatter's own row, or the second phase's reduced
// rows); the run's last decides it.
inline void PlanCore::decode_when_done(const std::shared_ptr<PlanCore>& self,
                                       const c10::intrusive_ptr<c10d::Work>& transfer,
                                       const std::shared_ptr<Run>& run, size_t k,
                                       const std::string& header) {
  transfer->getFuture()->addCallback([self, run, k, header](c10::ivalue::Future& done) {
    try {
      if (done.hasError()) {
        run->failed(done.exception_ptr());
      } else if (self->two_phase_) {
        self->decode_reduced_rows(self->pieces_[k], header, *run);
      } else if (self->scatter_) {
        self->decode_own_row(self->pieces_[k], header, *run);
      } else {
        self->decode_rows(self->pieces_[k], header, *run);
      }
    } catch (...) {
      run->failed(std::current_exception());
    }
    if (--run->left == 0) {
      self->decided(*run);
    } else if (run->awaiting) {  // (a hierarchical run's issuing thread waits: `await_decodes`)
      std::lock_guard<std::mutex> lock(run->mutex);
      run->decoded.notify_all();
    }
  });
}

// The decode of chunk `piece`'s second phase (on gloo's thread; as `chunking.decode_columns`):
// every rank's message of its reduced row into that row's columns of the source, cast; a
// message that does not belong to the call marks the run foreign, for `decided`.
inline void PlanCore::decode_reduced_rows(const Piece& piece, const std::string& header,
                                          Run& run) {
  const auto begun = std::chrono::steady_clock::now();
  const int64_t width = piece.b - piece.a, P = piece.again.size(1);
  at::Tensor messages = piece.again_received.view({world_, P});
  std::vector<int64_t> shards(world_);
  for (int64_t r = 0; r < world_; ++r) {
    shards[r] = r;
  }
  const int64_t verdict = api_->verify(messages, header, shards, checksum_, step_, run.threads);
  received(run, verdict);
  if (verdict < 0) {
    run.foreign = true;
  } else if (piece.a == 0 && piece.b == m_) {
    api_->decode_into(messages, m_, bits_, group_size_, format_, run.flat, run.threads);
  } else {
    for (int64_t r = 0; r < world_; ++r) {
      const int64_t lo = std::min(r * m_ + piece.a, numel_);
      const int64_t hi = std::min(r * m_ + piece.b, numel_);
      if (lo < hi) {
        api_->decode_into(messages.slice(0, r, r + 1), width, bits_, group_size_, format_,
                          run.flat.slice(0, lo, hi), run.threads);
      }
    }
  }
  run.decode_ns += nanos_since(begun);
}

// The decode of `piece` of an all-reduce's `run`, its all-gather complete (on gloo's thread;
// as `direct._decode_row` for each of its rows): a row whose messages do not belong to the
// call marks the run foreign, for `decided`.
inline void PlanCore::decode_rows(const Piece& piece, const std::string& header, Run& run) {
  const auto begun = std::chrono::steady_clock::now();
  const int64_t width = piece.b - piece.a, P = piece.sent.size(1);
  at::Tensor columns = piece.received.view({world_, piece.rows, P});
  for (int64_t i = 0; i < piece.rows && !run.foreign; ++i) {
    const int64_t r = piece.row0 + i;
    const int64_t lo = std::min(r * m_ + piece.a, numel_);
    const int64_t hi = std::min(r * m_ + piece.b, numel_);
    if (lo == hi) {
      continue;
    }
    at::Tensor messages = columns.select(1, i);
    const int64_t verdict = api_->verify(messages, header, std::vector<int64_t>(world_, r),
                                         checksum_, step_, run.threads);
    received(run, verdict);
    if (verdict < 0) {
      run.foreign = true;
      break;
    }
    sum_into(messages, width, run.flat.slice(0, lo, hi), run.threads);
  }
  run.decode_ns += nanos_since(begun);
}

// The decode of `piece` of a reduce-scatter's `run`, its all-to-all complete (on gloo's
// thread; as `direct._pipeline`'s `reduce_oldest`): every rank's message of this rank's row,
// summed in rank order into the output's columns; messages that do not belong to the call
// mark the run foreign, for `decided`.
inline void PlanCore::decode_own_row(const Piece& piece, const std::string& header, Run& run) {
  const auto begun = std::chrono::steady_clock::now();
  at::Tensor messages = piece.received.view({world_, piece.sent.size(1)});
  const int64_t verdict = api_->verify(messages, header, std::vector<int64_t>(world_, rank_),
                                       checksum_, step_, run.threads);
  received(run, verdict);
  if (verdict < 0) {
    run.foreign = true;
  } else {
    sum_into(messages, piece.b - piece.a, run.output.view({-1}).slice(0, piece.a, piece.b),
             run.threads);
  }
  run.decode_ns += nanos_since(begun);
}

}  // namespace lowbitcc
