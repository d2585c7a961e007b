//! Certificates made at test time: a CA, a server certificate for `localhost` and 127.0.0.1,
//! and client certificates with a given common name, written as PEM files.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use tenure::TlsOptions;
use tenure_server::tls::TlsFiles;

/// A certificate authority whose key is kept, to sign more certificates.
pub struct TestCa {
    cert: Certificate,
    key: KeyPair,
    /// The CA certificate, PEM.
    pub pem: String,
    /// Where the CA certificate's PEM was written.
    pub path: PathBuf,
}

/// A certificate and its key, as PEM files.
pub struct Issued {
    /// The certificate, PEM.
    pub cert: PathBuf,
    /// Its private key, PEM (PKCS#8).
    pub key: PathBuf,
}

impl TestCa {
    /// A new CA named `name`, its certificate written to `dir/<name>-ca.pem`.
    pub fn new(dir: &Path, name: &str) -> TestCa {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).expect("self-signed CA");
        let pem = cert.pem();
        let path = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&path, &pem).expect("write the CA certificate");
        TestCa {
            cert,
            key,
            pem,
            path,
        }
    }

    /// A server certificate for `localhost` and `127.0.0.1`, as `dir/<file>.pem` and `.key`.
    pub fn server(&self, dir: &Path, file: &str) -> Issued {
        let names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
        self.issue(
            dir,
            file,
            "tenured",
            names,
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// A client certificate whose subject common name is `name`.
    pub fn client(&self, dir: &Path, name: &str) -> Issued {
        self.issue(
            dir,
            name,
            name,
            Vec::new(),
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }

    /// A peer certificate for cluster node `id` (the DNS name `node-<id>.tenure`, for both
    /// server and client use), as `dir/node-<id>.pem` and `.key`.
    pub fn node(&self, dir: &Path, id: u64) -> Issued {
        let key = KeyPair::generate().expect("node key");
        let name = tenure_server::cluster::peer_tls::node_name(id);
        let mut params = CertificateParams::new(vec![name.clone()]).expect("node params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("sign the node certificate");
        let issued = Issued {
            cert: dir.join(format!("node-{id}.pem")),
            key: dir.join(format!("node-{id}.key")),
        };
        std::fs::write(&issued.cert, cert.pem()).expect("write the certificate");
        std::fs::write(&issued.key, key.serialize_pem()).expect("write the key");
        issued
    }

    fn issue(
        &self,
        dir: &Path,
        file: &str,
        common_name: &str,
        names: Vec<String>,
        usage: ExtendedKeyUsagePurpose,
    ) -> Issued {
        let key = KeyPair::generate().expect("leaf key");
        let mut params = CertificateParams::new(names).expect("leaf params");
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.extended_key_usages = vec![usage];
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("sign the leaf");
        let issued = Issued {
            cert: dir.join(format!("{file}.pem")),
            key: dir.join(format!("{file}.key")),
        };
        std::fs::write(&issued.cert, cert.pem()).expect("write the certificate");
        std::fs::write(&issued.key, key.serialize_pem()).expect("write the key");
        issued
    }

    /// The server's TLS files: `server`'s certificate and key, and this CA's clients if
    /// `client_ca`.
    pub fn server_files(&self, server: &Issued, client_ca: Option<&TestCa>) -> TlsFiles {
        TlsFiles {
            cert: server.cert.clone(),
            key: server.key.clone(),
            client_ca: client_ca.map(|ca| ca.path.clone()),
        }
    }

    /// Client options trusting this CA, without a client certificate.
    pub fn trust(&self) -> TlsOptions {
        TlsOptions::from_ca_pem(self.pem.as_bytes()).expect("client TLS options")
    }

    /// Client options trusting this CA and presenting `client`.
    pub fn trust_as(&self, client: &Issued) -> TlsOptions {
        TlsOptions::from_files(&self.path, Some((&client.cert, &client.key)))
            .expect("client TLS options with a certificate")
    }
}
