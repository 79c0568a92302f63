from typing import Optional, Sequence, Tuple

import numpy as np

def adam_many(params: Sequence[np.ndarray], grads: Sequence[np.ndarray], exp_avgs: Sequence[np.ndarray],
              exp_avg_sqs: Sequence[np.ndarray], scalars: Tuple[float, ...], l2: bool, decoupled: bool) -> None: ...
def sgd_many(params: Sequence[np.ndarray], grads: Sequence[np.ndarray], bufs: Optional[Sequence[np.ndarray]],
             scalars: Tuple[float, ...], l2: bool, momentum: bool, first: bool, dampened: bool,
             nesterov: bool) -> None: ...
