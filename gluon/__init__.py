"""gluon: communication-efficient LMO-based distributed optimisers.

Small pieces that compose: a compressor (:mod:`gluon.compressors`), an LMO per parameter
block (:mod:`gluon.lmo`), a communication backend that counts uplink cost
(:mod:`gluon.comm`), workers with their local oracles (:mod:`gluon.worker`) and the
algorithms written once against them (:mod:`gluon.methods`). :mod:`gluon.optim` runs them as
``torch.optim`` optimisers in the user's own training loop.
"""
from .comm import Comm, InProcessComm, Ledger, Message, encode
from .compressors import (COMPRESSORS, QSGD, Compressor, Identity, Natural, Packet, RandK,
                          TopK, Zero, make_compressor, message_seed)
from .engine import simulate, simulate_module, train
from .lmo import LMOS, RMS, Block, Euclidean, Sign, Spectral, assign_lmos, make_lmo, newton_schulz
from .methods import (METHODS, Alg1, Alg2, Alg3, Alg4, EF21Muon, GradientUpdate, LMOUpdate, Method,
                      MethodSpec, VRMarina, check_hparams, make_method, method_spec, resolve_method)
from .worker import ModuleOracle, Oracle, Worker
from . import optim  # torch.optim-style optimisers: gluon.optim.CompressedGluon, ...

__version__ = "0.1.0"
