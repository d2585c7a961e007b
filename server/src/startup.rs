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
        let mutual_tls = config
            .tls
            .as_ref()
            .is_some_and(|tls| tls.client_ca.is_some());
        if !addr.ip().is_loopback() && !mutual_tls {
            if !config.insecure_no_auth {
                return Err(ServerError::NoIdentities(addr));
            }
            warn_insecure_no_auth(addr);
        }
        return Ok(None);
    };
    let identities = Identities::load(path).map_err(ServerError::Identities)?;
    tracing::info!(path = %path.display(), "identities loaded");
    Ok(Some(Arc::new(identities)))
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

/// Takes an exclusive lock on `data_dir/LOCK` for the life of the server: two servers
/// appending to one log would each hand out the same fencing tokens.
pub(crate) fn lock_data_dir(dir: &std::path::Path) -> Result<std::fs::File, ServerError> {
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
