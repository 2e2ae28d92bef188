// The row layouts the ops exchange (csrc/ops_def.h), defined once for every backend, the
// torch-free kernels and Python (flce/_ops.py reads them through torch.ops.flce.row_layout):
//   partials [N, kPartialCols] = (m, s, z_t, sum_z, u): online logsumexp (m, s) of the
//            non-target logits, the target logit, the sum of all logits (label smoothing), the
//            entropy's sum u (math.h OnlineLse);
//   stats    [N, kStatsCols] = (m_x, s_x, z_t, u_x): the combined row statistics the backward
//            reads;
//   soft     [N, kSoftCols] = (m_x, s_x, p, u_x, y_a, y_rest, g): a target distribution's state
//            (math.h SoftRow; its pivot class a in a tensor of its own), partial and combined.
#pragma once

namespace flce {

constexpr int kPartialCols = 5;
constexpr int kStatsCols = 4;
constexpr int kSoftCols = 7;

}  // namespace flce
