//! `tenure certs`: a development CA and the certificates a secure cluster needs, made with
//! rcgen: one per node for peer TLS, naming it as `node-<id>.tenure` (the DNS name
//! `tenured`'s peer TLS reads the node id from, server/CLUSTER.md "Peer TLS"), and
//! optionally one for the client ports. Keys are ECDSA P-256 (PKCS#8 PEM), written 0600;
//! nothing is overwritten without `--force`. A directory that already holds the CA (and its
//! key) keeps it: the new certificates are signed by it, so a node added to a running
//! cluster gets one its peers trust. The openssl commands in CLUSTER.md make the same files.

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use clap::Args;
use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject as _;
use tenure::tls::pem_problem;

use crate::output::{Line, Out};

/// The name of a node's certificate: `tenured`'s peer TLS takes the node id from it.
fn node_name(id: u64) -> String {
    format!("node-{id}.tenure")
}

/// How long the CA is valid, from a day ago.
const CA_VALID: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// How long a node's or the client port's certificate is valid, from a day ago: 825 days,
/// the longest some TLS clients accept.
const LEAF_VALID: Duration = Duration::from_secs(825 * 24 * 3600);
/// How far back validity starts: a node whose clock is a little behind still accepts.
const BACKDATE: Duration = Duration::from_secs(24 * 3600);
/// Most node certificates one command makes (a cluster has at most 9 members; ids of
/// replaced nodes grow beyond).
const NODES_MAX: usize = 64;

/// Flags of `tenure certs`.
#[derive(Args, Debug)]
pub struct CertsArgs {
    /// Where the files go (created if missing): cluster-ca.pem and .key, node-<id>.pem and
    /// .key per node, server.pem and .key with --server.
    #[arg(long)]
    pub dir: PathBuf,
    /// The node ids to make peer certificates for, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',', required = true)]
    pub nodes: Vec<u64>,
    /// Host names or IP addresses the certificates also carry as subject alternative
    /// names (the addresses the nodes are reached at); repeatable.
    #[arg(long = "host", default_values = ["127.0.0.1", "localhost"])]
    pub hosts: Vec<String>,
    /// Also make server.pem/server.key for the client ports (--tls-cert/--tls-key), for
    /// the --host names, signed by the same CA (clients use --tls-ca cluster-ca.pem).
    #[arg(long)]
    pub server: bool,
    /// Replace files that exist, the CA too (a new CA: every node needs its new
    /// certificate). Without it, a CA already in --dir signs the new certificates.
    #[arg(long)]
    pub force: bool,
}

/// Runs `tenure certs`: prints one line naming the files.
///
/// # Errors
/// A bad node id, a file that exists without `--force` (but the CA, which is reused), a CA
/// without its key, or a file that cannot be read or written.
pub fn certs(out: &Out, args: CertsArgs) -> anyhow::Result<u8> {
    anyhow::ensure!(
        !args.nodes.is_empty() && args.nodes.len() <= NODES_MAX,
        "--nodes takes 1 to {NODES_MAX} ids"
    );
    anyhow::ensure!(args.nodes.iter().all(|id| *id >= 1), "node ids start at 1");
    let mut ids = args.nodes.clone();
    ids.sort_unstable();
    if let Some(twice) = ids.windows(2).find(|pair| pair[0] == pair[1]) {
        anyhow::bail!("--nodes names node {} twice", twice[0]);
    }
    let mut names: Vec<String> = args.nodes.iter().map(|id| format!("node-{id}")).collect();
    if args.server {
        names.push("server".to_string());
    }
    let files: Vec<PathBuf> = names
        .iter()
        .flat_map(|name| ["pem", "key"].map(|ext| args.dir.join(format!("{name}.{ext}"))))
        .collect();
    if !args.force {
        if let Some(exists) = files.iter().find(|file| file.exists()) {
            anyhow::bail!("{} exists (--force replaces it)", exists.display());
        }
    }
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("cannot create {}", args.dir.display()))?;
    let had_ca = args.dir.join("cluster-ca.pem").exists();
    let reused = !args.force && existing_ca(&args.dir)?;
    let (ca, ca_key) = if reused {
        warn_if_others_read(&args.dir.join("cluster-ca.key"));
        read_ca(&args.dir)?
    } else {
        let (ca, ca_key) = make_ca()?;
        write_pair(&args.dir, "cluster-ca", &ca, &ca_key)?;
        (ca, ca_key)
    };
    if had_ca && !reused {
        warn_of_orphans(&args.dir, &names);
    }
    for id in &args.nodes {
        let mut sans = vec![node_name(*id)];
        sans.extend(args.hosts.iter().cloned());
        let purposes = [
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let (cert, key) = make_leaf(&node_name(*id), sans, &purposes, (&ca, &ca_key))?;
        write_pair(&args.dir, &format!("node-{id}"), &cert, &key)?;
    }
    if args.server {
        let purposes = [ExtendedKeyUsagePurpose::ServerAuth];
        let (cert, key) = make_leaf("tenured", args.hosts.clone(), &purposes, (&ca, &ca_key))?;
        write_pair(&args.dir, "server", &cert, &key)?;
    }
    let nodes: Vec<String> = args.nodes.iter().map(u64::to_string).collect();
    let mut line = Line::new("OK")
        .text("dir", args.dir.display().to_string())
        .text("nodes", nodes.join(","));
    if args.server {
        line = line.text("server", "server.pem");
    }
    line = line.text("ca", if reused { "reused" } else { "new" });
    out.print(line);
    Ok(crate::exit::EXIT_OK)
}

/// Warns if the key at `path` may be read by others than its owner: anyone who reads the
/// CA's key can make certificates every node trusts.
fn warn_if_others_read(path: &Path) {
    if let Ok(meta) = std::fs::metadata(path) {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            crate::output::warn(&format!(
                "{} may be read by its group or others (mode {mode:04o}): whoever reads \
                 it can make certificates the nodes trust; chmod 600 it",
                path.display()
            ));
        }
    }
}

/// After `--force` replaced the CA in `dir`: warns of the certificates there that the old CA
/// signed and this command did not make again (`made`: the names it made), which the nodes
/// no longer trust.
fn warn_of_orphans(dir: &Path, made: &[String]) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut orphans: Vec<String> = entries
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter_map(|file| file.strip_suffix(".pem").map(str::to_string))
        .filter(|name| name != "cluster-ca" && !made.contains(name))
        .filter(|name| name == "server" || name.starts_with("node-"))
        .collect();
    if orphans.is_empty() {
        return;
    }
    orphans.sort();
    let files: Vec<String> = orphans.iter().map(|name| format!("{name}.pem")).collect();
    crate::output::warn(&format!(
        "a new CA replaced the old one in {}: {} were signed by the old CA, which the nodes \
         no longer trust once they load the new cluster-ca.pem; delete them and run \
         `tenure certs --dir {} --nodes {}` without --force (it signs with the new CA), \
         not with --force (that would make yet another CA)",
        dir.display(),
        files.join(", "),
        dir.display(),
        remake_args(&orphans),
    ));
}

/// The `--nodes` (and `--server`) that make `names` (`node-<id>`, `server`) again.
fn remake_args(names: &[String]) -> String {
    let ids: Vec<&str> = names
        .iter()
        .filter_map(|n| n.strip_prefix("node-"))
        .collect();
    let server = names.iter().any(|n| n == "server");
    match (ids.is_empty(), server) {
        (false, true) => format!("{} --server", ids.join(",")),
        (false, false) => ids.join(","),
        // `--nodes` is required: the server certificate alone comes with any node's.
        (true, _) => "<an id> --server".to_string(),
    }
}

/// Whether `dir` holds a CA to reuse: its certificate and its key (one without the other is
/// an error, not a reason to make a new CA beside certificates signed by the old one).
fn existing_ca(dir: &Path) -> anyhow::Result<bool> {
    let (pem, key) = (dir.join("cluster-ca.pem"), dir.join("cluster-ca.key"));
    match (pem.exists(), key.exists()) {
        (true, true) => Ok(true),
        (false, false) => Ok(false),
        _ => anyhow::bail!(
            "{} holds only one of cluster-ca.pem and cluster-ca.key (--force makes a new CA)",
            dir.display()
        ),
    }
}

/// The CA in `dir`, to sign with: its key, and its certificate rebuilt from its own fields
/// with that key (the same subject and key, so what it signs names and verifies as the CA
/// the nodes already trust).
fn read_ca(dir: &Path) -> anyhow::Result<(Certificate, KeyPair)> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))
    };
    let (key_pem, ca_pem) = (read("cluster-ca.key")?, read("cluster-ca.pem")?);
    // Read by rustls, which names what is wrong with a PEM file (rcgen only says
    // "malformed"), then given to rcgen.
    let key_der = rustls::pki_types::PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| anyhow::anyhow!("cluster-ca.key is no key: {}", pem_problem(&e)))?;
    let key = KeyPair::try_from(&key_der).context("cluster-ca.key is no key")?;
    let der = rustls::pki_types::CertificateDer::from_pem_slice(ca_pem.as_bytes())
        .map_err(|e| anyhow::anyhow!("cluster-ca.pem is no certificate: {}", pem_problem(&e)))?;
    // Its public key is inside the certificate's subject key info: what the CA's key signs
    // would not verify against a certificate of another key.
    let public = key.public_key_raw();
    anyhow::ensure!(
        der.windows(public.len()).any(|bytes| bytes == public),
        "cluster-ca.key is not the key of cluster-ca.pem"
    );
    let params = CertificateParams::from_ca_cert_pem(&ca_pem)
        .context("cluster-ca.pem is no CA certificate")?;
    // A node's certificate copied in as the CA would sign certificates nobody can verify.
    anyhow::ensure!(
        matches!(params.is_ca, IsCa::Ca(_)),
        "cluster-ca.pem is not a CA certificate (its basic constraints say CA:FALSE or nothing)"
    );
    Ok((params.self_signed(&key)?, key))
}

fn make_ca() -> anyhow::Result<(Certificate, KeyPair)> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "tenure development CA");
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    set_validity(&mut params, CA_VALID);
    Ok((params.self_signed(&key)?, key))
}

fn make_leaf(
    common_name: &str,
    sans: Vec<String>,
    purposes: &[ExtendedKeyUsagePurpose],
    (ca, ca_key): (&Certificate, &KeyPair),
) -> anyhow::Result<(Certificate, KeyPair)> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(sans).context("a --host is not a valid name")?;
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = purposes.to_vec();
    set_validity(&mut params, LEAF_VALID);
    Ok((params.signed_by(&key, ca, ca_key)?, key))
}

fn set_validity(params: &mut CertificateParams, valid: Duration) {
    let start = SystemTime::now() - BACKDATE;
    params.not_before = start.into();
    params.not_after = (start + valid).into();
}

/// Writes `dir/name.pem` (0644) and `dir/name.key` (0600).
fn write_pair(dir: &Path, name: &str, cert: &Certificate, key: &KeyPair) -> anyhow::Result<()> {
    write_file(
        &dir.join(format!("{name}.pem")),
        cert.pem().as_bytes(),
        0o644,
    )?;
    write_file(
        &dir.join(format!("{name}.key")),
        key.serialize_pem().as_bytes(),
        0o600,
    )
}

/// Writes `bytes` to `path` with `mode`: created so (a key is never readable by others,
/// not even for a moment), and set so when `--force` replaces a file.
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> anyhow::Result<()> {
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(path)?;
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
        file.write_all(bytes)?;
        file.sync_all()
    };
    write().with_context(|| format!("cannot write {}", path.display()))
}
