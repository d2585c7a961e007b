//! Mutual TLS on the peer port: every node holds a certificate from the cluster's CA that
//! names its node id, presents it both ways, and requires one of the other side.
//!
//! A certificate names node `N` by a DNS subject alternative name `node-N.tenure`
//! ([`node_name`]): a node dialling node `N` verifies the server's certificate for that name
//! (webpki, as for any host name), and a node accepting a connection takes the id its
//! client's certificate names as the connection's sender: [`super::network`] then refuses
//! every Raft frame that names another sender, so a certificate for node 2 cannot speak as
//! node 3. A connection without a certificate, or with one the CA did not sign, fails the
//! handshake: no frame of it is ever decoded. The same certificate serves as server and as
//! client certificate (no extended key usage, or both).
//!
//! `tenured cluster-init` dials with a certificate of the cluster too (any node's): only a
//! holder of one can make the first membership.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::TcpStream;
use tokio_rustls::{client, server, TlsAcceptor, TlsConnector};

use super::NodeId;
use crate::tls::{own_cert_problem, read_certs, read_key};

/// The DNS-name suffix of the name a node certificate carries: `node-<id>` + this.
pub const NODE_NAME_SUFFIX: &str = ".tenure";
/// The prefix of a node certificate's name.
pub const NODE_NAME_PREFIX: &str = "node-";

/// The name a certificate for node `id` carries (a DNS subject alternative name).
pub fn node_name(id: NodeId) -> String {
    format!("{NODE_NAME_PREFIX}{id}{NODE_NAME_SUFFIX}")
}

/// The node id a certificate name stands for, if it is one ([`node_name`]'s shape, id ≥ 1).
pub fn node_id_of(name: &str) -> Option<NodeId> {
    let id = name
        .strip_prefix(NODE_NAME_PREFIX)?
        .strip_suffix(NODE_NAME_SUFFIX)?;
    if id.starts_with('0') || !id.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    id.parse().ok().filter(|id| *id >= 1)
}

/// The files peer TLS is configured from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerTlsFiles {
    /// This node's certificate chain (PEM, leaf first), naming its id.
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The cluster's CA certificates (PEM): every peer's certificate must chain to one.
    pub ca: PathBuf,
}

/// Both ends of peer TLS, built once at start.
pub struct PeerTls {
    acceptor: TlsAcceptor,
    connector: TlsConnector,
    /// The node id this node's own certificate names.
    pub own_id: NodeId,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerTls(node {})", self.own_id)
    }
}

impl PeerTls {
    /// Reads the files and builds both ends.
    ///
    /// # Errors
    /// A file cannot be read or holds no usable certificate or key, or the certificate
    /// names no node id (or more than one); the message names the file.
    pub fn load(files: &PeerTlsFiles) -> Result<PeerTls, String> {
        let certs = read_certs(&files.cert, "peer TLS certificates")?;
        let own_id = cert_node_id(&certs[0])
            .map_err(|why| format!("peer TLS certificate {}: {why}", files.cert.display()))?;
        let key = || read_key(&files.key, "peer TLS key");
        let mut roots = RootCertStore::empty();
        for cert in read_certs(&files.ca, "peer TLS CA")? {
            roots
                .add(cert)
                .map_err(|e| format!("peer TLS CA {}: {e}", files.ca.display()))?;
        }
        let roots = Arc::new(roots);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(&provider))
                .build()
                .map_err(|e| format!("peer TLS CA {}: {e}", files.ca.display()))?;
        let pair = || format!("{} and {}", files.cert.display(), files.key.display());
        let server = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("peer TLS: {e}"))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), key()?)
            .map_err(|e| format!("peer TLS certificate {}: {}", pair(), own_cert_problem(&e)))?;
        let client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("peer TLS: {e}"))?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, key()?)
            .map_err(|e| format!("peer TLS certificate {}: {}", pair(), own_cert_problem(&e)))?;
        Ok(PeerTls {
            acceptor: TlsAcceptor::from(Arc::new(server)),
            connector: TlsConnector::from(Arc::new(client)),
            own_id,
        })
    }

    /// The server side of the handshake; returns the stream and the node id the client's
    /// certificate names.
    ///
    /// # Errors
    /// The handshake failed (no certificate, one the CA did not sign), or the certificate
    /// names no node.
    pub async fn accept(
        &self,
        tcp: TcpStream,
    ) -> Result<(server::TlsStream<TcpStream>, NodeId), String> {
        let stream = self
            .acceptor
            .accept(tcp)
            .await
            .map_err(|e| format!("peer TLS handshake: {e}"))?;
        let leaf = stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|certs| certs.first())
            .ok_or("peer TLS: no client certificate")?;
        let id = cert_node_id(leaf).map_err(|why| format!("peer TLS client certificate: {why}"))?;
        Ok((stream, id))
    }

    /// The client side of the handshake with node `target`, whose certificate must name it.
    ///
    /// # Errors
    /// The handshake failed, or the server's certificate does not name `target`.
    pub async fn connect(
        &self,
        tcp: TcpStream,
        target: NodeId,
    ) -> std::io::Result<client::TlsStream<TcpStream>> {
        let name = ServerName::try_from(node_name(target)).map_err(std::io::Error::other)?;
        self.connector.connect(name, tcp).await
    }
}

/// The node id a certificate names: exactly one DNS subject alternative name of
/// [`node_name`]'s shape.
fn cert_node_id(cert: &CertificateDer<'_>) -> Result<NodeId, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| format!("cannot parse it: {e}"))?;
    let names = cert
        .subject_alternative_name()
        .map_err(|e| format!("bad subject alternative names: {e}"))?;
    let mut ids = names.into_iter().flat_map(|ext| {
        ext.value
            .general_names
            .iter()
            .filter_map(|name| match name {
                x509_parser::extensions::GeneralName::DNSName(dns) => node_id_of(dns),
                _ => None,
            })
    });
    match (ids.next(), ids.next()) {
        (Some(id), None) => Ok(id),
        (None, _) => Err(format!(
            "it names no node (a DNS name {NODE_NAME_PREFIX}<id>{NODE_NAME_SUFFIX})"
        )),
        (Some(_), Some(_)) => Err("it names more than one node".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_round_trip_and_others_are_none() {
        for id in [1, 2, 9, 12_345, u64::MAX] {
            assert_eq!(node_id_of(&node_name(id)), Some(id));
        }
        for name in [
            "node-0.tenure",
            "node-01.tenure",
            "node-.tenure",
            "node-1.tenure.evil",
            "xnode-1.tenure",
            "node-+1.tenure",
            "node-1x.tenure",
            "node-99999999999999999999999.tenure",
            "localhost",
        ] {
            assert_eq!(node_id_of(name), None, "{name}");
        }
    }
}
