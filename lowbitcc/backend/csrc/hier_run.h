// The hierarchical schedule's run of a plan core (plan_core.h's `PlanCore`: its members here are
// declared there): lowbitcc/schedules/hierarchical.py, exact inside a node, the direct
// schedule's codes across nodes. Whole on its issuing thread, without the GIL:
//   1. the call's source times the op's factor in fp32 (`values`, zero past its end), its rows
//      by local rank all-to-all over the node's gloo group, and what arrived summed in local
//      rank order into `partial`: the node's exact sums of the rows this rank's rail carries
//      (`_node_reduce`);
//   2. the rail's run: the direct schedule's over the rail's gloo group (the core's transport)
//      with `partial` as its source (fp32, factor 1), its pieces, stages "hier.*", the core's
//      own (direct_run.h); an all-reduce's decodes write into `partial` itself (each transfer's
//      columns once its encodes have read them, so the sums are the Python path's, which
//      decodes into a buffer of its own); a reduce-scatter's into the call's output, and the
//      run ends there;
//   3. (an all-reduce) once every rail decode is done (`await_decodes`), `partial` all-gathered
//      over the node and each rank's rows put in their places of the call's tensor, cast.
// The bytes each step sends count as the node's (to this node's ranks) and the rail's (to other
// nodes'), as the Python path's metered links count them. Where a rail message does not belong
// to the call by the C++ check, the Python plan's decodes of the rail take over
// (`CallPlan.finish_received`): a reduce-scatter's once the run is decided, as the direct
// schedule's; an all-reduce's before the node's all-gather (`decode_rail_in_python`), so that
// what the node gathers is the Python path's rail sums and every rank completes the same
// transfers, the error they raise the run's. A failed transfer ends the run where it stands (its
// error the run's), as an exception ends the Python schedule. Included by plan_core.h after the
// class.
#pragma once

#include "plan_core.h"

namespace lowbitcc {

// The node steps of a hierarchical core's spec (whole_runs.py's `hier`).
inline Hier PlanCore::read_hier(py::dict h) {
  Hier hier;
  node_object_ = h["node"];
  deferred_errors_ = h["deferred_errors"];
  hier.node = node_object_.cast<c10::intrusive_ptr<c10d::Backend>>();
  hier.nodes = h["nodes"].cast<int64_t>();
  hier.node_size = h["node_size"].cast<int64_t>();
  hier.numel = h["numel"].cast<int64_t>();
  hier.dtype = reinterpret_cast<THPDtype*>(h["dtype"].ptr())->scalar_type;
  hier.factor = h["factor"].cast<double>();
  hier.values = h["values"].cast<at::Tensor>();
  hier.send = h["send"].cast<at::Tensor>();
  hier.received = h["received"].cast<at::Tensor>();
  hier.partial = h["partial"].cast<at::Tensor>();
  const int64_t size = hier.nodes * hier.node_size * m_;
  bool fit = hier.nodes == world_ && hier.node_size >= 2 && hier.values.numel() == size &&
             hier.send.numel() == size && hier.received.numel() == 4 * size &&
             hier.partial.numel() == hier.nodes * m_ && hier.numel <= size;
  if (!scatter_) {
    hier.gathered = h["gathered"].cast<at::Tensor>();
    hier.everything = h["everything"].cast<at::Tensor>();
    fit = fit && hier.gathered.numel() == 4 * size && hier.everything.numel() == size;
  }
  for (const at::Tensor* t : {&hier.values, &hier.send, &hier.partial, &hier.everything}) {
    fit = fit && (!t->defined() || (t->scalar_type() == at::kFloat && t->is_contiguous()));
  }
  fit = fit && hier.received.is_contiguous() &&
        (!hier.gathered.defined() || hier.gathered.is_contiguous());
  TORCH_CHECK(fit, "lowbitcc: a hierarchical plan core's buffers do not fit its call");
  return hier;
}

// A hierarchical run on its issuing thread (the file's comment).
inline void PlanCore::run_hier(const std::shared_ptr<PlanCore>& self,
                               const std::shared_ptr<Run>& run, const at::Tensor& sums) {
  Hier& h = *hier_;
  const int64_t N = h.nodes, L = h.node_size, size = N * L * m_;
  // 1. the node's reduce-scatter, exact (`hierarchical._node_reduce`)
  try {
    const at::Tensor flat = run->tensor.view({-1});
    const int64_t n = std::min(flat.numel(), size);
    h.values.slice(0, 0, n).copy_(flat.slice(0, 0, n));
    if (n < size) {
      h.values.slice(0, n).zero_();
    }
    if (h.factor != 1.0) {
      h.values.mul_(h.factor);
    }
    h.send.view({L, N, m_}).copy_(h.values.view({N, L, m_}).transpose(0, 1));
    std::vector<int64_t> equal;  // (empty: equal splits, as `all_to_all_async`)
    c10d::AllToAllOptions options;
    at::Tensor sent = h.send.view(at::kByte);
    auto transfer = h.node->alltoall_base(h.received, sent, equal, equal, options);
    run->sent.intra += (L - 1) * N * m_ * 4;  // a row of N m fp32 to each of the node's ranks
    transfer->wait();
    const at::Tensor arrived = h.received.view(at::kFloat).view({L, N * m_});
    h.partial.copy_(arrived[0]);
    for (int64_t l = 1; l < L; ++l) {
      h.partial.add_(arrived[l]);
    }
  } catch (...) {
    run->failed(std::current_exception());
    return;
  }
  // 2. the rail's run, the direct schedule's on the node's sums
  run->flat = h.partial;
  two_phase_ ? run_two_phases(self, run, sums) : run_pieces(self, run, sums);
  if (scatter_) {
    return;  // (its decodes write the call's output)
  }
  // 3. the node's all-gather, exact, once the rail's sums are decoded
  await_decodes(*run);
  const bool failed = run->has_error();  // (a transfer's error: the run ends, as in Python)
  if (run->foreign && !failed) {
    decode_rail_in_python(*run);
  }
  if (failed) {
    return;
  }
  try {
    node_gather(*run);
  } catch (...) {
    run->failed(std::current_exception());
  }
}

// An all-reduce's rail decodes where a rail message did not belong to the call by the C++ check:
// the Python plan's instead (`CallPlan.finish_received`, with the GIL), into `partial`, which so
// holds what the Python path's decodes write (its sums; NaN where its own check refuses a message
// too), and what they raise is the run's error, the node's all-gather still to run (every rank
// issues it); the run is then no longer foreign (`decided` hands nothing back again).
inline void PlanCore::decode_rail_in_python(Run& run) {
  run.foreign = false;
  // what the decodes raised is one of the call's deferred errors: NaN left where it was met;
  // anything else may have stopped them halfway, so no sum of this rank's rail goes to the node
  bool deferred = false;
  const auto begun = std::chrono::steady_clock::now();
  struct Timed {  // the time taken, however the decodes end (`python_ns`)
    Run& run;
    std::chrono::steady_clock::time_point begun;
    ~Timed() { run.python_ns += nanos_since(begun); }
  } timed{run, begun};
  try {
    if (finish_in_python(run)) {
      run.nonfinite = true;
    }
    return;
  } catch (py::error_already_set& error) {
    py::gil_scoped_acquire acquire;  // (`matches` asks the interpreter)
    deferred = error.matches(deferred_errors_);
    run.failed(std::current_exception());
  } catch (...) {
    run.failed(std::current_exception());
  }
  if (!deferred) {
    hier_->partial.fill_(std::numeric_limits<float>::quiet_NaN());
  }
}

// An all-reduce's last step (`hierarchical.all_reduce`'s node all-gather): the rail's sums
// (`partial`) all-gathered over the node, each rank's rows put in their places of the call's
// tensor, cast.
inline void PlanCore::node_gather(Run& run) {
  Hier& h = *hier_;
  const int64_t N = h.nodes, L = h.node_size;
  c10d::AllgatherOptions options;
  at::Tensor sent = h.partial.view(at::kByte);
  auto transfer = h.node->_allgather_base(h.gathered, sent, options);
  run.sent.intra += (L - 1) * N * m_ * 4;
  transfer->wait();
  const at::Tensor by_node = h.gathered.view(at::kFloat).view({L, N, m_}).transpose(0, 1);
  at::Tensor out = run.tensor.view({-1});
  if (out.numel() == N * L * m_) {  // straight into the call's tensor
    out.view({N, L, m_}).copy_(by_node);
    return;
  }
  h.everything.view({N, L, m_}).copy_(by_node);
  out.copy_(h.everything.slice(0, 0, out.numel()));
}

// Wait (on the issuing thread, without the GIL) until every transfer `run` started is decoded:
// only the issuing thread's token is left (each decode signals `decoded` once this waits).
inline void PlanCore::await_decodes(Run& run) {
  run.awaiting = true;
  std::unique_lock<std::mutex> lock(run.mutex);
  run.decoded.wait(lock, [&run] { return run.left.load() == 1; });
}

}  // namespace lowbitcc
