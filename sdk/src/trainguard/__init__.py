"""TrainGuard SDK: report crashes, metrics and memory signals of a PyTorch training job.

    import trainguard
    trainguard.init(endpoint="http://localhost:4318", project="llm", token="...")
    trainguard.watch(model, optimizer, scaler=scaler, clip=1.0)
    trainguard.log(step=step, loss=loss)

Nothing here ever raises into the training loop; see :mod:`trainguard.api`.
"""

from .api import (
    capture_exception,
    check_batch,
    flush,
    get_client,
    init,
    log,
    shutdown,
    watch,
    watch_lora,
)
from .options import Options
from .version import __version__

__all__ = [
           "Options",
           "__version__",
           "capture_exception",
           "check_batch",
           "flush",
           "get_client",
           "init",
           "log",
           "shutdown",
           "watch",
           "watch_lora",
]
