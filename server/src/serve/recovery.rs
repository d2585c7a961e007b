//! Start-up's recovery: the WAL replayed into a new executor.

use std::sync::Arc;

use crate::clock::Clock;
use crate::config::{Config, Durability};
use crate::error::ServerError;
use crate::executor::{Executor, ExecutorParts};
use crate::identity::Identities;
use crate::journal::{Journal, WalJournal};
use crate::wal::{self, SyncMode, WalOptions};

/// Opens the WAL in `storage` and rebuilds the lock table from it.
/// `dir_lock`, the data directory's lock, is held by the journal for as long as it lives.
pub(super) async fn recover(
    config: Config,
    storage: Arc<dyn wal::Storage>,
    dir_lock: Option<std::fs::File>,
    identities: Option<Arc<Identities>>,
) -> Result<Executor, ServerError> {
    let options = WalOptions {
        sync_mode: if config.fsync {
            SyncMode::Data
        } else {
            SyncMode::Off
        },
        segment_size_max: config.wal_segment_bytes_max,
        token_floor_margin: config.token_block,
        ..WalOptions::default()
    };
    let dir = storage.path("");
    // Real time on purpose: this only measures how long recovery took, for the log.
    let started = std::time::Instant::now();
    // Replay, restore and the collection after them run on one thread: the replayed copy of
    // the leases was allocated by this thread's allocator heap, and a forced collection only
    // returns the freed pages of the calling thread's heap to the OS. Meanwhile freed memory
    // goes back at once (see `PurgeAtOnce`), so none waits for a purge that would come late.
    let (shared, torn_tail_truncated) = tokio::task::spawn_blocking(move || {
        let purge_at_once = crate::memory::PurgeAtOnce::start();
        let (wal, recovered) = wal::open_with_storage(storage, options)
            .map_err(|source| ServerError::Recovery { dir, source })?;
        let clock = Clock::start();
        let now_ms = clock.now_ms();
        // In token-only mode held locks were not logged, so any of them may still be in use:
        // wait out the longest lease this server grants before granting again. Any segment or
        // floor file means a server ran here, even if a disk lost every record it wrote.
        let log_existed = recovered.segments > 0 || recovered.token_floor > 0;
        let refused_until_ms = match config.durability {
            Durability::Tokens if log_existed => now_ms + u64::from(config.ttl_ms_max),
            _ => 0,
        };
        let leases = recovered.leases.len();
        let journal: Arc<dyn Journal> = Arc::new(WalJournal::new(wal, config.durability, dir_lock));
        let shared = Executor::new(ExecutorParts {
            grants_refused_until_ms: refused_until_ms,
            identities,
            ..ExecutorParts::new(config, clock, journal, recovered.token_floor)
        });
        shared
            .stats()
            .metrics
            .recovered(started.elapsed(), refused_until_ms);
        shared.restore_sessions(now_ms, recovered.sessions); // before their leases
        shared.restore(now_ms, recovered.leases);
        // The replayed copy of the leases is gone; its memory goes back now, not whenever
        // the allocator next gets to it.
        crate::memory::release_freed();
        drop(purge_at_once);
        tracing::info!(
            leases,
            token_floor = recovered.token_floor,
            records = recovered.records,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "recovered from the WAL"
        );
        Ok::<_, ServerError>((shared, recovered.torn_tail_truncated))
    })
    .await
    .map_err(ServerError::RecoveryPanicked)??;
    if let Some((path, offset)) = &torn_tail_truncated {
        tracing::warn!(path = %path.display(), offset, "truncated a torn record at the end of the WAL");
    }
    Ok(shared)
}
