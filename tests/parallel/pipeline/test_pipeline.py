import numpy as np

import axonhpc as ax
from axonhpc import nn
from support.pipeline_cases import BATCH, CASES, make_data, make_stages
from support.runner import case_tests


test_pipeline_case_local, test_pipeline_case_mpi = case_tests(CASES)


def test_exported():
    assert ax.Pipeline is ax.parallel.Pipeline
    assert "Pipeline" in ax.__all__ and "Pipeline" in ax.parallel.__all__


def test_one_rank_holds_every_chunk():
    # P = 1 with 3 chunks: stage hand-overs are local, no message is sent.
    def run(world):
        stages = make_stages(3)
        pipe = ax.Pipeline.from_modules(stages, num_microbatches=4, schedule="interleaved_1f1b",
                                        loss_fn=nn.CrossEntropyLoss(), stages_per_rank=3)
        x, y = make_data(0)
        loss = pipe.train_step(x, y)
        model = nn.Sequential(*make_stages(3))
        loss_fn = nn.CrossEntropyLoss()
        expected = loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        np.testing.assert_allclose(loss, expected, rtol=1e-12, atol=1e-12)
        for q, q_ref in zip(pipe.parameters(), model.parameters()):
            np.testing.assert_allclose(q.grad, q_ref.grad, rtol=1e-12, atol=1e-12)
        assert pipe.last_step_stats["messages_sent"] == 0
        np.testing.assert_allclose(pipe.forward(x), model(x), rtol=1e-12, atol=1e-12)
        assert pipe.forward(x).shape == (BATCH, 3)

    ax.run_local(run, world_size=1)
