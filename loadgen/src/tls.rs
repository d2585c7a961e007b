//! TLS to a tenure target: the CA to trust, the client certificate for mutual TLS and the name
//! the server's certificate must carry. rustls with the ring provider, as `tenured` and the
//! `tenure` client use, so the figures measure the same TLS stack.
//!
//! Only the CA given is trusted, never the system's roots: a lock server's certificate comes
//! from an organisation's own CA (the client crate's rule too).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// The TLS flags as given.
pub struct TlsFlags<'a> {
    /// `--tls-ca`: the CA certificates to trust, PEM.
    pub ca: &'a Path,
    /// `--tls-client-cert` and `--tls-client-key`, both or neither.
    pub client: Option<(&'a PathBuf, &'a PathBuf)>,
    /// `--tls-server-name`, else the target's host.
    pub server_name: &'a str,
}

/// A loaded TLS configuration, ready to wrap connections.
pub struct Tls {
    connector: TlsConnector,
    server_name: ServerName<'static>,
    name_text: String,
}

impl Tls {
    /// Reads the PEM files and builds the client configuration.
    ///
    /// # Errors
    /// Naming the file or flag that cannot be read or used.
    pub fn load(flags: &TlsFlags<'_>) -> anyhow::Result<Tls> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots(flags.ca)?);
        let config = match flags.client {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = certificates(cert, "--tls-client-cert")?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .with_context(|| format!("--tls-client-key {}", key.display()))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .context("--tls-client-cert and --tls-client-key do not fit together")?
            }
        };
        let server_name = ServerName::try_from(flags.server_name.to_owned())
            .with_context(|| format!("TLS server name {:?}", flags.server_name))?;
        Ok(Tls {
            connector: TlsConnector::from(Arc::new(config)),
            server_name,
            name_text: flags.server_name.to_owned(),
        })
    }

    /// Runs the TLS handshake over a connected socket.
    ///
    /// # Errors
    /// When the handshake fails: an untrusted certificate, the wrong name, a plain-text port.
    pub async fn handshake(&self, stream: TcpStream) -> anyhow::Result<TlsStream<TcpStream>> {
        match self
            .connector
            .connect(self.server_name.clone(), stream)
            .await
        {
            Ok(tls) => Ok(tls),
            Err(e) => bail!("TLS handshake with {} failed: {e}", self.name_text),
        }
    }
}

fn certificates(path: &Path, flag: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("{flag} {}", path.display()))?;
    if certs.is_empty() {
        bail!("{flag} {}: no certificate in the PEM", path.display());
    }
    Ok(certs)
}

fn roots(ca: &Path) -> anyhow::Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for cert in certificates(ca, "--tls-ca")? {
        roots
            .add(cert)
            .with_context(|| format!("--tls-ca {}", ca.display()))?;
    }
    Ok(roots)
}
