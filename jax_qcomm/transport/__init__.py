"""How bytes move between devices: axis arguments (:mod:`.axes`), the all-to-all and all-gather
schedules the codecs send their messages with (:mod:`._exchange`), the per-device ("varying")
checks (:mod:`._varying`), and the transport's cost model (:mod:`.cost`).

``qcomm.transport`` is the cost model's public name: :class:`Transport`, :data:`GLOO`,
:data:`GLOO_PAIR`, :data:`IDEAL` and :func:`current` are importable from here.
"""

from jax_qcomm.transport.cost import GLOO, GLOO_PAIR, IDEAL, Transport, current  # noqa: F401
