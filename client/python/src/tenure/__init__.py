"""tenure: the Python client of the tenure lock server.

Blocking::

    import tenure

    client = tenure.Client("127.0.0.1:7878")
    with client.lock("order:1842", ttl=30, wait=10) as lease:
        lease.check()                 # raises LeaseLost once the lease is gone
        write(..., token=lease.token) # fence every write on the token

asyncio::

    async with tenure.AsyncClient("127.0.0.1:7878") as client:
        async with client.lock("order:1842", ttl=30, cancel_on_loss=True) as lease:
            ...

Durations are seconds (floats); keys and metadata are str (UTF-8) or bytes.
"""

from ._wire import ServerLimits
from .aio import (
    AsyncClient,
    AsyncElection,
    AsyncLeadership,
    AsyncLeaseGuard,
    AsyncObserver,
    AsyncWatch,
    Credentials,
    TlsOptions,
)
from .client import Client, Election, Leadership, LeaseGuard, Observer, Watch
from .session import AsyncSession, AsyncSessionLock, Session, SessionLock
from .errors import (
    AcquireEnded,
    BadRequest,
    CannotConnect,
    ClusterRefused,
    ConnectionLost,
    Forbidden,
    HandshakeError,
    BadPermits,
    InvalidArgument,
    KindMismatch,
    LeaseLost,
    LimitReached,
    NotAcquired,
    NoSession,
    NotLeader,
    ProtocolError,
    Quota,
    Recovering,
    RequestTimeout,
    ServerError,
    ShuttingDown,
    TenureError,
    Unauthenticated,
    Unavailable,
    WatchLimit,
)
from .semaphore import HeldKinds
from .fence import Fence, Rejected, SequencedFence, fenced_update
from .results import (
    AcquireResult,
    CheckResult,
    Current,
    Event,
    EventKind,
    Free,
    Granted,
    Held,
    KeyState,
    Leader,
    Lease,
    Locked,
    Lost,
    NotOwner,
    Released,
    ReleaseResult,
    Renewed,
    RenewResult,
    Stale,
)

__version__ = "0.1.0"

__all__ = [
    "AcquireEnded", "AcquireResult", "AsyncClient", "BadPermits", "HeldKinds", "KindMismatch", "AsyncElection",
    "AsyncLeadership", "AsyncLeaseGuard",
    "AsyncObserver", "AsyncWatch", "BadRequest", "CannotConnect", "CheckResult", "Client", "ClusterRefused", "ConnectionLost",
    "Credentials", "Current", "Election", "Event", "EventKind", "Fence", "Forbidden", "Free",
    "Granted", "HandshakeError", "Held", "InvalidArgument", "KeyState", "Leader", "Leadership",
    "Lease", "LeaseGuard", "LeaseLost", "LimitReached", "Locked", "Lost", "NotAcquired",
    "NotLeader", "NotOwner", "Observer", "ProtocolError", "Quota", "Recovering", "Rejected",
    "Released", "ReleaseResult", "Renewed", "RenewResult", "RequestTimeout", "SequencedFence",
    "ServerError", "ServerLimits", "ShuttingDown", "Stale", "TenureError", "TlsOptions",
    "Unauthenticated", "Unavailable", "Watch", "WatchLimit", "fenced_update",
    "AsyncSession", "AsyncSessionLock", "NoSession", "Session", "SessionLock",
]
