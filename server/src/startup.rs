//! What starting to serve needs in both modes, before and beside the accept loop: the data
//! directory's lock, the TLS files, the identities, and their reload on SIGHUP.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::error::ServerError;
use crate::identity::Identities;
use crate::tls::Tls;

/// Reads the TLS files, if TLS is configured.
pub(crate) fn load_tls(config: &Config) -> Result<Option<Arc<Tls>>, ServerError> {
    let Some(files) = &config.tls else {
        return Ok(None);
    };
    let tls = Tls::load(files.clone()).map_err(ServerError::Tls)?;
    tracing::info!(cert = %files.cert.display(), mutual = files.client_ca.is_some(), "TLS on");
    Ok(Some(Arc::new(tls)))
}

/// Reads the identities file if one is configured. Without one, only a loopback address is
/// served unless mutual TLS (a client CA) stands in for identities or `insecure_no_auth` says
/// otherwise: the secure choice is the default.
pub(crate) fn load_identities(
    config: &Config,
    addr: std::net::SocketAddr,
) -> Result<Option<Arc<Identities>>, ServerError> {
    let Some(path) = &config.identities else {
        if is_exposed(config, addr) {
            refuse_exposed(config, addr)?;
            warn_insecure_no_auth(addr);
        }
        return Ok(None);
    };
    let identities = Identities::load(path).map_err(ServerError::Identities)?;
    tracing::info!(path = %path.display(), "identities loaded");
    Ok(Some(Arc::new(identities)))
}

/// Whether serving `addr` with `config` lets anyone who reaches it in without a word:
/// not loopback, no identities, and no client CA (mutual TLS) to stand in for them.
fn is_exposed(config: &Config, addr: std::net::SocketAddr) -> bool {
    let mutual_tls = config
        .tls
        .as_ref()
        .is_some_and(|tls| tls.client_ca.is_some());
    config.identities.is_none() && !addr.ip().is_loopback() && !mutual_tls
}

/// Refuses to serve `addr` to anyone at all unless `--insecure-no-auth` says so. A start
/// checks it when it binds, and `tenured --print-config` before (outside test a48, N4).
///
/// # Errors
/// [`ServerError::NoIdentities`] for an exposed address without `insecure_no_auth`.
pub fn refuse_exposed(config: &Config, addr: std::net::SocketAddr) -> Result<(), ServerError> {
    if is_exposed(config, addr) && !config.insecure_no_auth {
        return Err(ServerError::NoIdentities(addr));
    }
    Ok(())
}

/// The warning every mode logs when `--insecure-no-auth` lets it serve `addr`, a
/// non-loopback address, to anyone who can reach it.
pub(crate) fn warn_insecure_no_auth(addr: std::net::SocketAddr) {
    tracing::warn!(%addr, "serving a non-loopback address WITHOUT identities (--insecure-no-auth)");
}

/// Reloads the identities and the TLS files on every SIGHUP until `stop`. A reload that fails
/// keeps what is in force and says why in the log; connections stay open either way. With
/// neither, a SIGHUP is only logged: its default action would end the server.
pub(crate) fn spawn_reloader(
    identities: Option<Arc<Identities>>,
    tls: Option<Arc<Tls>>,
    stop: CancellationToken,
) -> Result<(), ServerError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hangup = signal(SignalKind::hangup())
        .map_err(|e| ServerError::Config(format!("cannot install the SIGHUP handler: {e}")))?;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                got = hangup.recv() => if got.is_none() { return },
            }
            if let Some(tls) = &tls {
                let tls = Arc::clone(tls);
                match tokio::task::spawn_blocking(move || tls.reload()).await {
                    Ok(Ok(())) => tracing::info!("TLS certificate and key reloaded"),
                    Ok(Err(error)) => {
                        tracing::error!(%error, "TLS reload failed; the old files stay in force")
                    }
                    Err(error) => tracing::error!(%error, "TLS reload panicked"),
                }
            }
            let Some(identities) = &identities else {
                tracing::info!("SIGHUP: no identities file to reload (identities need a restart)");
                continue;
            };
            let reloaded = {
                let identities = Arc::clone(identities);
                tokio::task::spawn_blocking(move || identities.reload()).await
            };
            match reloaded {
                Ok(Ok(count)) => tracing::info!(count, "identities reloaded"),
                Ok(Err(error)) => {
                    tracing::error!(%error, "identities reload failed; the old ones stay in force")
                }
                Err(error) => tracing::error!(%error, "identities reload panicked"),
            }
        }
    });
    Ok(())
}

/// Which kind of server a data directory is opened for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DirMode {
    /// A single node: its write-ahead log and token floors (module `wal`).
    Single,
    /// A cluster node: its Raft log, vote, snapshot and cluster id (module `cluster`).
    Cluster,
}

/// The files only a cluster node keeps (module `cluster`; a test holds the names to its
/// constants).
const CLUSTER_FILES: &[&str] = &["raft.log", "raft.state", "raft.snapshot", "cluster.id"];

/// Whether `name` is a file only a single node keeps: a WAL segment (`wal-<seq>.log`) or a
/// token floor (`floor-<floor>.tok`; a test holds the patterns to module `wal`'s names).
fn single_node_file(name: &str) -> bool {
    let between = |prefix, suffix| name.starts_with(prefix) && name.ends_with(suffix);
    between("wal-", ".log") || between("floor-", ".tok")
}

/// The first file of `dir` that the other kind of server than `mode` keeps, if any. An
/// empty one holds nothing to lose and does not count: a cluster node that never formed
/// leaves an empty `raft.log`, which refused a single node the directory for good
/// (outside test a47, M8).
fn foreign_file(dir: &std::path::Path, mode: DirMode) -> std::io::Result<Option<String>> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let foreign = match mode {
            DirMode::Single => CLUSTER_FILES.contains(&name.as_str()),
            DirMode::Cluster => single_node_file(&name),
        };
        if foreign && entry.metadata()?.len() > 0 {
            return Ok(Some(name));
        }
    }
    Ok(None)
}

/// Takes an exclusive lock on `data_dir/LOCK` for the life of the server: two servers
/// appending to one log would each hand out the same fencing tokens. Then refuses a
/// directory that holds the other kind of server's files: a cluster node does not read a
/// single node's WAL, so it would not see its leases and would hand out their keys again
/// under fencing tokens from 1, below the ones already given (outside test a46, L1), and a
/// single node on a cluster node's directory would bring back leases its WAL still had
/// beside the cluster's.
pub(crate) fn lock_data_dir(
    dir: &std::path::Path,
    mode: DirMode,
) -> Result<std::fs::File, ServerError> {
    let file = lock_dir(dir)?;
    let io_error = |source| ServerError::DataDir {
        what: "cannot read",
        path: dir.to_path_buf(),
        source,
    };
    match foreign_file(dir, mode).map_err(io_error)? {
        None => Ok(file),
        Some(found) => Err(ServerError::DataDirOfOtherMode {
            dir: dir.to_path_buf(),
            found,
            cluster: mode == DirMode::Cluster,
        }),
    }
}

/// `lock_data_dir`'s lock: creates `dir` if need be and locks its `LOCK` file.
fn lock_dir(dir: &std::path::Path) -> Result<std::fs::File, ServerError> {
    let io_error = |what, path: &std::path::Path| {
        let path = path.to_path_buf();
        move |source| ServerError::DataDir { what, path, source }
    };
    std::fs::create_dir_all(dir).map_err(io_error("cannot create", dir))?;
    let path = dir.join("LOCK");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_error("cannot open", &path))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(ServerError::DataDirInUse(dir.to_path_buf())),
        Err(std::fs::TryLockError::Error(e)) => Err(io_error("cannot lock", &path)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_names_are_those_each_mode_writes() {
        assert!(single_node_file(&crate::wal::segment_name(1)));
        assert!(single_node_file(&crate::wal::floor::floor_name(0x20_0001)));
        assert!(!single_node_file("LOCK"));
        for name in [
            crate::cluster::log_store::LOG_FILE,
            crate::cluster::log_store::STATE_FILE,
            crate::cluster::state::SNAPSHOT_FILE,
            crate::cluster::cluster_id::ID_FILE,
        ] {
            assert!(CLUSTER_FILES.contains(&name), "{name}");
            assert!(!single_node_file(name), "{name}");
        }
    }

    /// A single node's directory is refused to a cluster node and the other way round; a
    /// fresh one, or one of the same mode, is taken (outside test a46, L1).
    #[test]
    fn a_data_dir_of_the_other_mode_is_refused() {
        let single = tempfile::tempdir().unwrap();
        std::fs::write(single.path().join(crate::wal::segment_name(1)), b"x").unwrap();
        let cluster = tempfile::tempdir().unwrap();
        std::fs::write(single.path().join("notes.txt"), b"").unwrap();
        std::fs::write(cluster.path().join("raft.log"), b"x").unwrap();
        let refused = |dir: &std::path::Path, mode| match lock_data_dir(dir, mode) {
            Err(ServerError::DataDirOfOtherMode { found, .. }) => found,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            refused(single.path(), DirMode::Cluster),
            "wal-0000000000000001.log"
        );
        assert_eq!(refused(cluster.path(), DirMode::Single), "raft.log");
        drop(lock_data_dir(single.path(), DirMode::Single).unwrap());
        drop(lock_data_dir(cluster.path(), DirMode::Cluster).unwrap());
        let fresh = tempfile::tempdir().unwrap();
        let fresh = fresh.path().join("new");
        drop(lock_data_dir(&fresh, DirMode::Cluster).unwrap());
        drop(lock_data_dir(&fresh, DirMode::Single).unwrap());
    }

    /// An empty file of the other mode holds nothing: a cluster node that never formed
    /// leaves an empty `raft.log`, and a single node may take its directory (a47, M8).
    #[test]
    fn an_empty_file_of_the_other_mode_is_not_refused() {
        let never_formed = tempfile::tempdir().unwrap();
        std::fs::write(never_formed.path().join("raft.log"), b"").unwrap();
        drop(lock_data_dir(never_formed.path(), DirMode::Single).unwrap());
        let single = tempfile::tempdir().unwrap();
        std::fs::write(single.path().join(crate::wal::segment_name(1)), b"").unwrap();
        drop(lock_data_dir(single.path(), DirMode::Cluster).unwrap());
    }
}
