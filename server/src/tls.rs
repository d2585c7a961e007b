//! TLS for the client port: the certificate and key (PEM) the server presents, and optionally
//! a CA whose client certificates it requires (mutual TLS).
//!
//! The files are read at start and again on SIGHUP, so a certificate can be rotated without
//! dropping connections: connections already open keep the session they have, new ones get
//! the new certificate. A reload that fails leaves the old configuration in force.
//!
//! With a client CA, a client certificate's subject common name stands for the identity of
//! that name, if one is configured: the connection starts authenticated, without AUTH.
//!
//! A peer that speaks plain text to a TLS port (a first byte that cannot start a TLS record)
//! is told so in its own language, a handshake refusal or an `ERR` line, and closed.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::BytesMut;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tenure_protocol::handshake::{HelloAck, VERSION};
use tenure_protocol::ErrorCode;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// The first byte of every TLS record that opens a connection (a handshake record).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;
/// What a plain-text peer of a TLS port is told.
const TLS_REQUIRED: &str = "this port requires TLS (tenure --tls-ca FILE, or \
    openssl s_client -connect HOST:PORT for the console)";

/// The files TLS is configured from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server's certificate chain, PEM, leaf first.
    pub cert: PathBuf,
    /// The certificate's private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA certificates (PEM) that client certificates must chain to; `None`: no client
    /// certificates are asked for.
    pub client_ca: Option<PathBuf>,
}

/// The server's TLS configuration, replaceable by [`Tls::reload`].
pub struct Tls {
    files: TlsFiles,
    acceptor: RwLock<TlsAcceptor>,
    /// The client CA certificates (DER) the acceptor in force trusts; empty without any.
    trusted: RwLock<Arc<[CertificateDer<'static>]>>,
}

/// A connection once TLS is set up.
pub struct Accepted {
    /// The encrypted stream.
    pub stream: TlsStream<TcpStream>,
    /// The verified client certificate's subject common name (mutual TLS only).
    pub peer_name: Option<String>,
}

impl Tls {
    /// Reads the files and builds the configuration.
    ///
    /// # Errors
    /// A file cannot be read or holds no usable certificate or key; the message names it.
    pub fn load(files: TlsFiles) -> Result<Tls, String> {
        let (acceptor, trusted) = build(&files)?;
        Ok(Tls {
            files,
            acceptor: RwLock::new(acceptor),
            trusted: RwLock::new(trusted),
        })
    }

    /// The files this configuration came from.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Reads the files again; on success new connections use them.
    ///
    /// # Errors
    /// As [`Tls::load`]; the configuration in force is then unchanged.
    pub fn reload(&self) -> Result<(), String> {
        let (acceptor, trusted) = build(&self.files)?;
        *self
            .acceptor
            .write()
            .expect("the TLS configuration lock is never poisoned") = acceptor;
        *self
            .trusted
            .write()
            .expect("the TLS configuration lock is never poisoned") = trusted;
        Ok(())
    }

    /// The client CA certificates in force (DER), as loaded last; empty without
    /// `--tls-client-ca`. What the trust digest of CLUSTER STATUS is taken over.
    pub fn trusted(&self) -> Arc<[CertificateDer<'static>]> {
        let trusted = self
            .trusted
            .read()
            .expect("the TLS configuration lock is never poisoned");
        Arc::clone(&trusted)
    }

    /// Runs the TLS handshake on an accepted socket, within `limit`. `None` if the peer
    /// failed it, spoke plain text (after telling it so), or took too long.
    pub async fn accept(&self, stream: TcpStream, limit: Duration) -> Option<Accepted> {
        let acceptor = self
            .acceptor
            .read()
            .expect("the TLS configuration lock is never poisoned")
            .clone();
        let handshake = async {
            let mut first = [0u8; 1];
            if stream.peek(&mut first).await.ok()? == 0 {
                return None;
            }
            if first[0] != TLS_HANDSHAKE_RECORD {
                refuse_plaintext(stream, first[0]).await;
                return None;
            }
            match acceptor.accept(stream).await {
                Ok(stream) => {
                    let peer_name = peer_common_name(&stream);
                    Some(Accepted { stream, peer_name })
                }
                Err(error) => {
                    tracing::debug!(%error, "TLS handshake failed");
                    None
                }
            }
        };
        tokio::time::timeout(limit, handshake).await.ok().flatten()
    }
}

/// Tells a plain-text peer, in the surface its first byte chose, that TLS is required.
async fn refuse_plaintext(mut stream: TcpStream, first: u8) {
    let mut out = BytesMut::new();
    if first == 0x00 {
        HelloAck::encode_refusal(VERSION, ErrorCode::BadHandshake, TLS_REQUIRED, &mut out);
    } else {
        out.extend_from_slice(format!("ERR BAD_HANDSHAKE {TLS_REQUIRED}\n").as_bytes());
    }
    tracing::debug!("refused a plain-text connection to the TLS port");
    if stream.write_all(&out).await.is_ok() {
        crate::linger::linger(&mut stream).await;
    }
}

/// The subject common name of the client's verified certificate, if it sent one.
fn peer_common_name(stream: &TlsStream<TcpStream>) -> Option<String> {
    let (_, session) = stream.get_ref();
    let leaf = session.peer_certificates()?.first()?;
    let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref()).ok()?;
    let name = cert.subject().iter_common_name().next()?;
    name.as_str().ok().map(str::to_owned)
}

/// The acceptor for `files`, and the client CA certificates it trusts.
fn build(files: &TlsFiles) -> Result<(TlsAcceptor, Arc<[CertificateDer<'static>]>), String> {
    let certs = read_certs(&files.cert, "TLS certificates")?;
    let key = read_key(&files.key, "TLS key")?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let mut trusted = Vec::new();
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let mut roots = RootCertStore::empty();
            trusted = read_certs(path, "TLS client CA")?;
            for cert in trusted.iter().cloned() {
                roots
                    .add(cert)
                    .map_err(|e| format!("TLS client CA {}: {e}", path.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("TLS client CA {}: {e}", path.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder.with_single_cert(certs, key).map_err(|e| {
        format!(
            "TLS certificate {} and key {}: {}",
            files.cert.display(),
            files.key.display(),
            own_cert_problem(&e)
        )
    })?;
    Ok((TlsAcceptor::from(Arc::new(config)), trusted.into()))
}

/// The certificates in the PEM file `path` (at least one); an error names it as `what`.
pub(crate) fn read_certs(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{what} {}: {}", path.display(), pem_problem(&e)))?;
    if certs.is_empty() {
        return Err(format!(
            "{what} {}: no certificate in the file",
            path.display()
        ));
    }
    Ok(certs)
}

/// The private key in the PEM file `path`; an error names it as `what`.
pub(crate) fn read_key(path: &Path, what: &str) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| format!("{what} {}: {}", path.display(), pem_problem(&e)))
}

/// What is wrong with this node's own certificate or key, in words: rustls words a
/// certificate it cannot read as a peer's ("invalid peer certificate"), which misled
/// operators reloading their own file (outside test a63, F5).
pub(crate) fn own_cert_problem(e: &rustls::Error) -> String {
    match e {
        rustls::Error::InvalidCertificate(why) => {
            format!("the certificate cannot be used ({why:?})")
        }
        rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch) => {
            "the key does not match the certificate (it is another certificate's key)".to_string()
        }
        rustls::Error::InconsistentKeys(why) => {
            format!("the key cannot be checked against the certificate ({why:?})")
        }
        other => other.to_string(),
    }
}

/// What is wrong with a PEM file, in words: rustls-pki-types prints the marker it missed
/// as a list of byte values. (The client crate has its own, `tenure::tls::pem_problem`:
/// the server does not depend on the client, and no crate both share has rustls in it.)
fn pem_problem(e: &pem::Error) -> String {
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).trim().to_string();
    match e {
        pem::Error::MissingSectionEnd { end_marker } => format!(
            "cut short or damaged: no \"-----END {}-----\" line",
            text(end_marker)
        ),
        pem::Error::IllegalSectionStart { line } => {
            format!("damaged: a bad BEGIN line {:?}", text(line))
        }
        pem::Error::NoItemsFound => "no PEM section of the kind needed in the file".to_string(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PEM file cut short is named by the line it lacks, not by that line's byte values.
    #[test]
    fn a_pem_file_cut_short_is_named_by_the_line_it_lacks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cut.pem");
        std::fs::write(&path, "-----BEGIN CERTIFICATE-----\nMIIB\n").unwrap();
        let why = read_certs(&path, "TLS certificates").unwrap_err();
        assert!(
            why.ends_with(r#"cut.pem: cut short or damaged: no "-----END CERTIFICATE-----" line"#),
            "{why}"
        );
        let why = read_key(&path, "TLS key").err().unwrap();
        assert!(why.contains("cut short or damaged"), "{why}");
        std::fs::write(&path, "no PEM here\n").unwrap();
        let why = read_certs(&path, "TLS certificates").unwrap_err();
        assert!(why.ends_with("no certificate in the file"), "{why}");
    }

    /// A server certificate that is PEM but not a certificate is named as this server's
    /// own, not as a peer's (outside test a63, F5: "invalid peer certificate").
    #[test]
    fn a_broken_own_certificate_is_not_called_a_peers() {
        let dir = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let files = TlsFiles {
            cert: dir.path().join("server.pem"),
            key: dir.path().join("server.key"),
            client_ca: None,
        };
        std::fs::write(&files.key, key.serialize_pem()).unwrap();
        let garbage = "-----BEGIN CERTIFICATE-----\nAAECAwQFBgcICQ==\n-----END CERTIFICATE-----\n";
        std::fs::write(&files.cert, garbage).unwrap();
        let why = build(&files).err().unwrap();
        assert!(why.contains("server.pem and key"), "{why}");
        assert!(why.contains("the certificate cannot be used"), "{why}");
        assert!(!why.contains("peer"), "{why}");
    }

    #[test]
    fn a_key_of_another_certificate_is_said_to_be_so() {
        let dir = tempfile::tempdir().unwrap();
        let files = TlsFiles {
            cert: dir.path().join("server.pem"),
            key: dir.path().join("server.key"),
            client_ca: None,
        };
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        std::fs::write(&files.cert, cert.cert.pem()).unwrap();
        let other = rcgen::KeyPair::generate().unwrap();
        std::fs::write(&files.key, other.serialize_pem()).unwrap();
        let why = build(&files).err().unwrap();
        assert!(
            why.contains("the key does not match the certificate"),
            "{why}"
        );
        assert!(!why.contains("KeyMismatch"), "{why}");
    }
}
