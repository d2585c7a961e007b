//! TLS to the server: which CA to trust, the client certificate for mutual TLS, and the name
//! the server's certificate must carry.
//!
//! The client trusts only the CA it is given, never the system's roots: a lock server's
//! certificate normally comes from an organisation's own CA, and trusting every public CA
//! would let anyone with a public certificate for the name stand in for the server.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use crate::error::{Error, Result};

/// What is wrong with a PEM file that did not parse, in words (rustls-pki-types prints the
/// marker it missed as a list of byte values): for tools that read certificate files.
pub fn pem_problem(e: &pem::Error) -> String {
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).trim().to_string();
    match e {
        pem::Error::MissingSectionEnd { end_marker } => format!(
            "cut short or damaged: no \"-----END {}-----\" line",
            text(end_marker)
        ),
        pem::Error::IllegalSectionStart { line } => {
            format!("damaged: a bad BEGIN line {:?}", text(line))
        }
        pem::Error::NoItemsFound => "no PEM section of the kind needed".to_string(),
        other => other.to_string(),
    }
}

/// How to speak TLS to the server. Cheap to clone.
#[derive(Clone)]
pub struct TlsOptions {
    config: Arc<ClientConfig>,
    server_name: Option<String>,
}

impl std::fmt::Debug for TlsOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsOptions")
            .field("server_name", &self.server_name)
            .field(
                "client_certificate",
                &self.config.client_auth_cert_resolver.has_certs(),
            )
            .finish()
    }
}

impl TlsOptions {
    /// Trust the CA certificates in `ca_pem` (PEM text); no client certificate.
    ///
    /// # Errors
    /// [`Error::Tls`] when the text holds no usable certificate.
    pub fn from_ca_pem(ca_pem: &[u8]) -> Result<TlsOptions> {
        Self::build(ca_pem, None)
    }

    /// Trust the CA certificates in `ca_pem` and present `cert_pem` (a chain, leaf first) with
    /// its private key `key_pem` to a server that asks for a client certificate.
    ///
    /// # Errors
    /// [`Error::Tls`] when a PEM text holds nothing usable or the key does not fit.
    pub fn from_pem_with_client_cert(
        ca_pem: &[u8],
        cert_pem: &[u8],
        key_pem: &[u8],
    ) -> Result<TlsOptions> {
        Self::build(ca_pem, Some((cert_pem, key_pem)))
    }

    /// As [`TlsOptions::from_ca_pem`] or, with `client`, [`TlsOptions::from_pem_with_client_cert`],
    /// reading the files.
    ///
    /// # Errors
    /// [`Error::Tls`] naming the file that cannot be read or used.
    pub fn from_files(ca: &Path, client: Option<(&Path, &Path)>) -> Result<TlsOptions> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|e| Error::Tls(format!("{}: {e}", path.display())))
        };
        let ca_pem = read(ca)?;
        match client {
            None => Self::from_ca_pem(&ca_pem),
            Some((cert, key)) => {
                Self::from_pem_with_client_cert(&ca_pem, &read(cert)?, &read(key)?).map_err(
                    // Name the files (outside test a66, 9: the words alone did not).
                    |e| match e {
                        Error::Tls(why) => Error::Tls(format!(
                            "{why} (client certificate {}, key {})",
                            cert.display(),
                            key.display()
                        )),
                        other => other,
                    },
                )
            }
        }
    }

    /// Use an already built rustls configuration (for roots or policies not covered here).
    pub fn from_rustls(config: Arc<ClientConfig>) -> TlsOptions {
        TlsOptions {
            config,
            server_name: None,
        }
    }

    /// The name the server's certificate must carry; by default the host part of the
    /// address connected to (a DNS name, or an IP address matched against the certificate's
    /// IP addresses).
    pub fn with_server_name(mut self, name: impl Into<String>) -> TlsOptions {
        self.server_name = Some(name.into());
        self
    }

    fn build(ca_pem: &[u8], client: Option<(&[u8], &[u8])>) -> Result<TlsOptions> {
        let mut roots = RootCertStore::empty();
        let cas = CertificateDer::pem_slice_iter(ca_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Error::Tls(format!("CA certificates: {}", pem_problem(&e))))?;
        if cas.is_empty() {
            return Err(Error::Tls(
                "CA certificates: no certificate in the PEM".into(),
            ));
        }
        for ca in cas {
            roots
                .add(ca)
                .map_err(|e| Error::Tls(format!("CA certificate: {e}")))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Tls(e.to_string()))?
            .with_root_certificates(roots);
        let config = match client {
            None => builder.with_no_client_auth(),
            Some((cert_pem, key_pem)) => {
                let chain = CertificateDer::pem_slice_iter(cert_pem)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| Error::Tls(format!("client certificate: {}", pem_problem(&e))))?;
                if chain.is_empty() {
                    return Err(Error::Tls(
                        "client certificate: no certificate in the PEM".into(),
                    ));
                }
                let key = PrivateKeyDer::from_pem_slice(key_pem)
                    .map_err(|e| Error::Tls(format!("client key: {}", pem_problem(&e))))?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    Error::Tls(format!("client certificate and key: {}", own_problem(&e)))
                })?
            }
        };
        Ok(TlsOptions::from_rustls(Arc::new(config)))
    }

    /// Runs the TLS handshake over `stream`, connected to `addr` (`host:port`).
    pub(crate) async fn connect(
        &self,
        addr: &str,
        stream: TcpStream,
    ) -> Result<TlsStream<TcpStream>> {
        let name = match &self.server_name {
            Some(name) => name.clone(),
            None => host_of(addr).to_owned(),
        };
        let server_name = ServerName::try_from(name.clone())
            .map_err(|e| Error::Tls(format!("server name {name:?}: {e}")))?;
        TlsConnector::from(Arc::clone(&self.config))
            .connect(server_name, stream)
            .await
            .map_err(|e| handshake_error(&name, e))
    }
}

/// A failed handshake: a TLS failure (the certificate, the protocol) is [`Error::Tls`] and not
/// worth retrying; a plain I/O failure (a reset, a close) stays [`Error::Io`].
fn handshake_error(name: &str, error: std::io::Error) -> Error {
    let tls = error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .cloned();
    match tls {
        Some(tls) => Error::Tls(format!("TLS handshake with {name} failed: {tls}")),
        None => Error::Io(error),
    }
}

/// What is wrong with the client's own certificate and key, in words: rustls says "keys
/// may not be consistent: KeyMismatch" for a key of another certificate (outside test a65,
/// 5; `tenured` says it as this does).
fn own_problem(e: &rustls::Error) -> String {
    match e {
        rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch) => {
            "the key does not match the certificate (it is another certificate's key)".into()
        }
        rustls::Error::InvalidCertificate(why) => {
            format!("the certificate cannot be used ({why:?})")
        }
        other => other.to_string(),
    }
}

/// `host` of `host:port`, `[v6]:port` or a bare host.
fn host_of(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.parse::<u16>().is_ok() => host,
        _ => addr,
    }
}

#[cfg(test)]
mod tests {
    use super::host_of;

    #[test]
    fn host_is_the_address_without_its_port() {
        assert_eq!(host_of("locks.internal:7878"), "locks.internal");
        assert_eq!(host_of("127.0.0.1:7878"), "127.0.0.1");
        assert_eq!(host_of("[::1]:7878"), "::1");
        assert_eq!(host_of("locks.internal"), "locks.internal");
        assert_eq!(host_of("::1"), "::1");
    }

    #[test]
    fn a_key_of_another_certificate_is_said_to_be_so() {
        let ca = rcgen::generate_simple_self_signed(vec!["ca".to_string()]).unwrap();
        let cert = rcgen::generate_simple_self_signed(vec!["client".to_string()]).unwrap();
        let other = rcgen::KeyPair::generate().unwrap();
        let err = super::TlsOptions::from_pem_with_client_cert(
            ca.cert.pem().as_bytes(),
            cert.cert.pem().as_bytes(),
            other.serialize_pem().as_bytes(),
        )
        .err()
        .unwrap();
        assert!(
            err.to_string()
                .contains("the key does not match the certificate"),
            "{err}"
        );
    }

    #[test]
    fn a_bad_client_pair_from_files_names_the_files() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, cert, key) = ("ca.pem", "client.pem", "client.key");
        let ca_cert = rcgen::generate_simple_self_signed(vec!["ca".to_string()]).unwrap();
        let client = rcgen::generate_simple_self_signed(vec!["client".to_string()]).unwrap();
        let other = rcgen::KeyPair::generate().unwrap();
        std::fs::write(dir.path().join(ca), ca_cert.cert.pem()).unwrap();
        std::fs::write(dir.path().join(cert), client.cert.pem()).unwrap();
        std::fs::write(dir.path().join(key), other.serialize_pem()).unwrap();
        let (cert, key) = (dir.path().join(cert), dir.path().join(key));
        let err = super::TlsOptions::from_files(&dir.path().join(ca), Some((&cert, &key)))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("the key does not match the certificate"),
            "{err}"
        );
        assert!(err.contains(&key.display().to_string()), "{err}");
        assert!(err.contains(&cert.display().to_string()), "{err}");
    }

    #[test]
    fn pem_without_a_certificate_is_refused_with_a_reason() {
        let err = super::TlsOptions::from_ca_pem(b"not a pem").unwrap_err();
        assert!(err.to_string().contains("no certificate"), "{err}");
    }
}
