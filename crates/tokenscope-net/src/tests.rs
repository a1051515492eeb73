use super::test_util::TestPki;
use super::*;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

fn pki() -> (tempfile::TempDir, TestPki) {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = TestPki::generate(dir.path()).expect("test PKI");
    (dir, pki)
}

fn opts(ca: Option<&Path>, cert: Option<&Path>, key: Option<&Path>) -> TlsOptions {
    TlsOptions {
        ca_file: ca.map(Path::to_owned),
        client_cert: cert.map(Path::to_owned),
        client_key: key.map(Path::to_owned),
    }
}

#[test]
fn bad_files_are_named_with_what_is_wrong() {
    let (dir, pki) = pki();
    let missing = dir.path().join("nope.pem");
    let err = ClientTls::new(&opts(Some(&missing), None, None)).expect_err("missing");
    assert!(matches!(err, TlsError::Read { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("CA file") && msg.contains("nope.pem"), "{msg}");

    // Text without any PEM block: no certificate.
    let text = dir.path().join("text.pem");
    std::fs::write(&text, "hello\n").expect("write");
    let err = ClientTls::new(&opts(Some(&text), None, None)).expect_err("no cert");
    assert!(matches!(err, TlsError::NoCertificate { .. }), "{err}");
    assert!(err.to_string().contains("text.pem"), "{err}");

    // A broken PEM block.
    let broken = dir.path().join("broken.pem");
    std::fs::write(&broken, "-----BEGIN CERTIFICATE-----\nAAAA\n").expect("write");
    let err = ClientTls::new(&opts(Some(&broken), None, None)).expect_err("broken");
    assert!(matches!(err, TlsError::Pem { .. }), "{err}");
    assert!(err.to_string().contains("broken.pem"), "{err}");

    // A key file given as the CA: no certificate in it.
    let err = ClientTls::new(&opts(Some(&pki.client_key), None, None)).expect_err("a key");
    assert!(matches!(err, TlsError::NoCertificate { .. }), "{err}");

    // A certificate given as the key: no key in it.
    let err = ClientTls::new(&opts(None, Some(&pki.client_cert), Some(&pki.client_cert)))
        .expect_err("a cert as key");
    assert!(matches!(err, TlsError::NoKey { .. }), "{err}");
    assert!(err.to_string().contains("client key"), "{err}");

    // Half a pair.
    let err = ClientTls::new(&opts(None, Some(&pki.client_cert), None)).expect_err("half");
    assert!(
        err.to_string()
            .contains("client_cert is set but client_key is not"),
        "{err}"
    );
    let err = ClientTls::new(&opts(None, None, Some(&pki.client_key))).expect_err("half");
    assert!(
        err.to_string()
            .contains("client_key is set but client_cert is not"),
        "{err}"
    );

    // A key that is not the certificate's.
    let err = ClientTls::new(&opts(None, Some(&pki.client_cert), Some(&pki.server_key)))
        .expect_err("mismatch");
    assert!(matches!(err, TlsError::Identity { .. }), "{err}");

    // The server side names its files the same way.
    let err = server_config(&pki.server_key, &pki.server_key, None, &[]).expect_err("key as cert");
    assert!(err.to_string().contains("server certificate"), "{err}");
    assert!(server_config(&pki.server_cert, &pki.server_key, Some(&pki.ca), &[]).is_ok());
}

#[test]
fn options_and_handles() {
    assert!(TlsOptions::from_paths(Some(" "), None, Some("")).is_default());
    let o = TlsOptions::from_paths(Some("/ca.pem"), None, None);
    assert_eq!(o.ca_file.as_deref(), Some(Path::new("/ca.pem")));
    // Default options share the one system configuration.
    let a = ClientTls::new(&TlsOptions::default()).expect("system");
    assert_eq!(a, ClientTls::system());
    let (_dir, pki) = pki();
    let b = ClientTls::new(&opts(Some(&pki.ca), None, None)).expect("with CA");
    assert_ne!(a, b);
    assert!(format!("{b:?}").contains("ca.pem"));
}

#[test]
fn server_names() {
    assert!(matches!(
        server_name("127.0.0.1"),
        Ok(ServerName::IpAddress(_))
    ));
    assert!(matches!(server_name("[::1]"), Ok(ServerName::IpAddress(_))));
    assert!(matches!(server_name("::1"), Ok(ServerName::IpAddress(_))));
    assert!(matches!(
        server_name("engine.local"),
        Ok(ServerName::DnsName(_))
    ));
    assert!(server_name("bad name!").is_err());
}

/// An HTTPS server answering `ok` on every path; with `client_ca` it requires client
/// certificates.
async fn https_server(pki: &TestPki, client_ca: Option<&Path>) -> std::net::SocketAddr {
    let cfg = server_config(
        &pki.server_cert,
        &pki.server_key,
        client_ca,
        &[b"h2", b"http/1.1"],
    )
    .expect("server config");
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let listener = TlsListener::new(tcp, cfg).expect("listener");
    let addr = axum::serve::Listener::local_addr(&listener).expect("addr");
    let app = axum::Router::new().fallback(|| async { "ok" });
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

async fn get(tls: &ClientTls, versions: Versions, url: &str) -> Result<(String, String), String> {
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build(connector(
        tls,
        ConnectOptions {
            timeout: Some(Duration::from_secs(5)),
            nodelay: true,
            keepalive: None,
            versions,
        },
    ));
    let resp = client
        .get(url.parse().expect("uri"))
        .await
        .map_err(|e| error_chain(&e))?;
    let version = format!("{:?}", resp.version());
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((version, String::from_utf8_lossy(&body).into_owned()))
}

#[tokio::test]
async fn https_with_the_ca_and_refused_without_it() {
    let (_dir, pki) = pki();
    let addr = https_server(&pki, None).await;
    let trusted = ClientTls::new(&opts(Some(&pki.ca), None, None)).expect("client");
    for host in ["127.0.0.1".to_owned(), "localhost".to_owned()] {
        let url = format!("https://{host}:{}/x", addr.port());
        let (version, body) = get(&trusted, Versions::Http1, &url).await.expect("https");
        assert_eq!((version.as_str(), body.as_str()), ("HTTP/1.1", "ok"));
    }
    // HTTP/2 when offered and the server prefers it.
    let url = format!("https://127.0.0.1:{}/x", addr.port());
    let (version, _) = get(&trusted, Versions::Any, &url).await.expect("h2");
    assert_eq!(version, "HTTP/2.0");

    // The system roots do not know the test CA; nor does another CA.
    let err = get(&ClientTls::system(), Versions::Http1, &url)
        .await
        .expect_err("untrusted");
    assert!(
        err.contains("invalid peer certificate") && err.contains("UnknownIssuer"),
        "{err}"
    );
    let wrong = ClientTls::new(&opts(Some(&pki.other_ca), None, None)).expect("client");
    let err = get(&wrong, Versions::Http1, &url)
        .await
        .expect_err("wrong CA");
    assert!(err.contains("UnknownIssuer"), "{err}");
}

#[tokio::test]
async fn client_certificates() {
    let (_dir, pki) = pki();
    let addr = https_server(&pki, Some(&pki.ca)).await;
    let url = format!("https://localhost:{}/x", addr.port());
    let without = ClientTls::new(&opts(Some(&pki.ca), None, None)).expect("client");
    // TLS 1.3: the server's refusal arrives after the client's handshake ended, as an alert
    // on the first read; either way the request fails.
    assert!(get(&without, Versions::Http1, &url).await.is_err());
    let with = ClientTls::new(&opts(
        Some(&pki.ca),
        Some(&pki.client_cert),
        Some(&pki.client_key),
    ))
    .expect("client");
    let (_, body) = get(&with, Versions::Http1, &url).await.expect("mTLS");
    assert_eq!(body, "ok");
}

#[tokio::test]
async fn the_connect_timeout_covers_the_handshake() {
    // Accepts TCP, never answers the ClientHello.
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = tcp.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = tcp.accept().await {
            held.push(s);
        }
    });
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build(connector(
        &ClientTls::system(),
        ConnectOptions {
            timeout: Some(Duration::from_millis(200)),
            ..ConnectOptions::default()
        },
    ));
    let started = std::time::Instant::now();
    let err = client
        .get(
            format!("https://127.0.0.1:{}/", addr.port())
                .parse()
                .expect("uri"),
        )
        .await
        .expect_err("timeout");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        error_chain(&err).contains("timed out"),
        "{}",
        error_chain(&err)
    );
}

#[tokio::test]
async fn plain_http_still_works() {
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = tcp.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(tcp, axum::Router::new().fallback(|| async { "plain" })).await;
    });
    let (_, body) = get(
        &ClientTls::system(),
        Versions::Http1,
        &format!("http://{addr}/"),
    )
    .await
    .expect("http");
    assert_eq!(body, "plain");
}

#[tokio::test]
async fn connector_set_uses_each_origins_tls() {
    let (_dir, pki) = pki();
    let addr = https_server(&pki, None).await;
    let with_ca = ClientTls::new(&opts(Some(&pki.ca), None, None)).expect("client");
    let plain = ConnectOptions {
        timeout: Some(Duration::from_secs(5)),
        ..ConnectOptions::default()
    };
    let mut set = ConnectorSet::new(connector(&ClientTls::system(), plain));
    let trusted: Uri = format!("https://LOCALHOST:{}/base", addr.port())
        .parse()
        .expect("uri");
    set.insert(&trusted, connector(&with_ca, plain));
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build(set);
    let ok = client
        .get(
            format!("https://localhost:{}/x", addr.port())
                .parse()
                .expect("uri"),
        )
        .await
        .expect("trusted origin");
    assert_eq!(ok.status(), 200);
    // The same server under another name is another origin: the default (system roots).
    let err = client
        .get(
            format!("https://127.0.0.1:{}/x", addr.port())
                .parse()
                .expect("uri"),
        )
        .await
        .expect_err("default connector");
    assert!(
        error_chain(&err).contains("UnknownIssuer"),
        "{}",
        error_chain(&err)
    );
    assert_eq!(
        origin(&"HTTPS://Engine:443/v1".parse().expect("uri")),
        origin(&"https://engine".parse().expect("uri"))
    );
}
