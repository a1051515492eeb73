//! Certificates for tests (cargo feature `test-util`): a CA, a server certificate it signed for
//! `localhost`, `127.0.0.1` and `::1`, a client certificate it signed, and an unrelated CA (the
//! "wrong CA" of a client that must not trust the server), written as PEM files.

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use std::path::{Path, PathBuf};

/// PEM files of a small test PKI (see the module docs).
#[derive(Debug, Clone)]
pub struct TestPki {
    /// The CA that signed the server and client certificates.
    pub ca: PathBuf,
    /// The server certificate (`localhost`, `127.0.0.1`, `::1`).
    pub server_cert: PathBuf,
    /// Its key.
    pub server_key: PathBuf,
    /// A client certificate (for mutual TLS).
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    /// Another CA, which signed none of these.
    pub other_ca: PathBuf,
}

fn ca(name: &str) -> Result<CertifiedIssuer<'static, KeyPair>, rcgen::Error> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    CertifiedIssuer::self_signed(params, KeyPair::generate()?)
}

impl TestPki {
    /// Generates the PKI and writes it into `dir` (`ca.pem`, `server.pem`, `server-key.pem`,
    /// `client.pem`, `client-key.pem`, `other-ca.pem`).
    pub fn generate(dir: &Path) -> Result<Self, Box<dyn std::error::Error>> {
        let issuer = ca("tokenscope test CA")?;
        let other = ca("tokenscope other CA")?;

        let mut server = CertificateParams::new(vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
            "::1".to_owned(),
        ])?;
        server
            .distinguished_name
            .push(DnType::CommonName, "tokenscope test server");
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_key = KeyPair::generate()?;
        let server_cert = server.signed_by(&server_key, &issuer)?;

        let mut client = CertificateParams::new(Vec::<String>::new())?;
        client
            .distinguished_name
            .push(DnType::CommonName, "tokenscope test client");
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_key = KeyPair::generate()?;
        let client_cert = client.signed_by(&client_key, &issuer)?;

        let write = |name: &str, pem: String| -> std::io::Result<PathBuf> {
            let p = dir.join(name);
            std::fs::write(&p, pem)?;
            Ok(p)
        };
        Ok(Self {
            ca: write("ca.pem", issuer.pem())?,
            server_cert: write("server.pem", server_cert.pem())?,
            server_key: write("server-key.pem", server_key.serialize_pem())?,
            client_cert: write("client.pem", client_cert.pem())?,
            client_key: write("client-key.pem", client_key.serialize_pem())?,
            other_ca: write("other-ca.pem", other.pem())?,
        })
    }
}
