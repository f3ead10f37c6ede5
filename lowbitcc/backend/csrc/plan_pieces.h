// What a plan core's runs are made of (plan_core.h): its encodes (`Encode`), its transfers
// (`Piece`), the tree's and the ring's runs on this rank (`Tree`, `Ring`) and the hierarchical
// schedule's node steps (`Hier`), read once from the plan's spec
// (lowbitcc/backend/plan_cores.py) into the buffers the plan keeps.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace lowbitcc {

// The bytes a run's started transfers send (as `counters.Stats.add_sent` counts them): to ranks
// on this rank's node, and to others'.
struct SentBytes {
  int64_t intra = 0, inter = 0;
};

// One encode of a transfer (see the file's comment): rows `row0 .. row0 + rows` of the source,
// the transfer's columns of each, into `messages` (uint8 [rows, P], contiguous: the transfer's
// `sent` or one of its rows) with `nonfinite`, framed as shards `shards`; with error feedback,
// its state is the run's `TakenStates` slot `slot` (feedback_slots.h).
struct Encode {
  int64_t row0, rows;
  at::Tensor messages, nonfinite;
  std::vector<int64_t> shards;
  size_t slot = 0;
};

// One transfer of a run: columns `a .. b` of the rows its `encodes` write into `sent` (uint8
// [rows, P]) under the header `header` (its call number overwritten by each run); all-gathered
// (a two ranks' all-reduce: the rows `row0 .. row0 + rows`, [2 * rows * P] received) or sent to
// all (a reduce-scatter, and the first phase of an all-reduce on more ranks: every row, row j to
// rank j; [world * P] received, rank j's message of this rank's row at j) into `received`. An
// all-reduce on more ranks also all-gathers its second phase: this rank's message of the
// reduced row in `again` (uint8 [1, P]; its groups' non-finite bytes in `again_nonfinite`),
// every rank's into `again_received` ([world * P], rank j's at j); undefined otherwise (and its
// encode's error state slot `again_slot`).
struct Piece {
  int64_t row0, rows, a, b, used;
  std::vector<Encode> encodes;
  at::Tensor sent, received;
  std::string header;
  at::Tensor again, again_nonfinite, again_received;
  size_t again_slot = 0;
};

// A tree schedule's run on this rank (see the file's comment): its `children` (none: a leaf)
// and `parent` (-1: the root); its one encode of every row (`encode`: the root's stage
// "tree.down", the others' "tree.up", its messages uint8 [world, P]) under `header`, of the
// rank's own values where it is a leaf, else of `partial` (fp32 [world * m]: its values times
// the op's factor plus its children's sums); `from_children` (uint8 [children, world, P]: child
// i's messages at i; undefined for a leaf) and `from_parent` (uint8 [world, P], the root's codes;
// undefined for the root) receive.
struct Tree {
  std::vector<int64_t> children;
  int64_t parent = -1;
  Piece piece;  // (its one encode; `a` .. `b` every column)
  at::Tensor partial, from_children, from_parent;
};

// A ring schedule's run on this rank (see the file's comment): its neighbours `left` and
// `right`; per step s (0 .. world - 2) and chunk k, `steps[s][k]`, the encode of what it sends (one
// row: at step 0 the segment's columns of the source, later `partial`, columns 0 .. its width),
// and `arrived[s][k]` (uint8 [P_k]), what it receives; per chunk, `chunks[k]` (its columns, header
// and used bytes) and, an all-reduce's, `gathers[k]`: the encode of its reduced row into row
// `rank` of `gathered` (uint8 [world, P_k], its `again_received`, every rank's row forwarded there),
// and `spreads[k]`, the same buffers under the chunk's columns for their decode. `partial` and
// `own` (fp32 [widest chunk]): a step's sum, and the rank's own values it adds; `reduced` (fp32
// [m]): each chunk's reduced row (a reduce-scatter's, unless the output takes it straight).
struct Ring {
  int64_t left = 0, right = 0;
  std::vector<std::vector<Piece>> steps;
  std::vector<std::vector<at::Tensor>> arrived;
  std::vector<Piece> chunks, gathers, spreads;
  at::Tensor partial, own, reduced;
};

// A hierarchical schedule's node steps on this rank (lowbitcc/schedules/hierarchical.py; `nodes`
// N of `node_size` L ranks, rows of m): over the node's gloo group `node`, the call's source
// (`numel` elements of `dtype`, times `factor`) in `values` (fp32 [N L m], zero past its end),
// its rows by local rank in `send` (fp32 [L, N m]), all-to-all into `received` (uint8
// [4 L N m]) and summed in local-rank order into `partial` (fp32 [N m]), the rail's source; an
// all-reduce's rail decodes into `partial` too, which the node then all-gathers into
// `gathered` (uint8 [4 L N m]) and the call's tensor takes in row order (through `everything`,
// fp32 [N L m], where it is shorter).
struct Hier {
  c10::intrusive_ptr<c10d::Backend> node;
  int64_t nodes = 0, node_size = 0, numel = 0;
  at::ScalarType dtype = at::kFloat;
  double factor = 1.0;
  at::Tensor values, send, received, partial, gathered, everything;
};

}  // namespace lowbitcc
