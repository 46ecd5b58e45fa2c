//! Who may see and change what, and the headers every response carries.
//!
//! One token guards the console (`--admin-token`). Scripts send it as
//! `Authorization: Bearer <token>`; browsers post it once to `/login` and get
//! a session cookie. Without a token the console is read-only (and the CLI
//! refuses to listen anywhere but loopback).
//!
//! Nothing is stored per session: the cookie is `issued.nonce.tag`, the tag
//! an HMAC-SHA256 of the rest under a key drawn at startup, so a restart
//! ends every session and a forged or edited cookie fails the tag. Each
//! session's CSRF token is the HMAC of its nonce under the same key (with
//! another label): mutations from a browser post it in a hidden field, which
//! a page of another origin cannot read. Bearer requests carry no ambient
//! credential and need no CSRF token.
//!
//! Every comparison with a secret goes through [`Mac::verify_slice`], which
//! is constant-time. The token is never logged, and its `Debug` is redacted.
//!
//! Not the `cookie` crate's signed jar (nor axum-extra's): it would sign the
//! value, but the session's expiry (a browser's `Max-Age` is only a hint),
//! the CSRF token and the token's tag need this keyed HMAC anyway, so it
//! would replace a few lines with a dependency and a second key.

use std::fmt;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use chrono::Utc;
use hmac::{Hmac, Mac};
use maud::html;
use sha2::Sha256;

use crate::form::Params;
use crate::view;

type HmacSha256 = Hmac<Sha256>;

/// The session cookie's name.
const COOKIE: &str = "outbox_admin";
/// How long a browser session lasts.
const SESSION_SECONDS: i64 = 12 * 3600;
/// The shortest token accepted: a guessable token on a console that
/// requeues events is worse than none.
pub const MIN_TOKEN_LEN: usize = 16;

/// The Content-Security-Policy of every response: no script at all, styles
/// and images from the console itself (and inline `data:` images), forms
/// posting only back to it, never framed.
pub const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; \
                       frame-ancestors 'none'; base-uri 'none'";

/// The admin token, redacted in `Debug`.
#[derive(Clone)]
pub struct Token(String);

impl Token {
    /// A token of at least [`MIN_TOKEN_LEN`] characters, else None.
    pub fn new(token: String) -> Option<Token> {
        (token.chars().count() >= MIN_TOKEN_LEN).then_some(Token(token))
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// The secrets of one console process.
pub(crate) struct Auth {
    /// The HMAC of the token under `key`, which a presented token's HMAC
    /// must equal; None: no token, read-only.
    token_tag: Option<Vec<u8>>,
    key: [u8; 32],
    secure_cookie: bool,
}

/// What a request may do, found by [`guard`].
#[derive(Clone, Debug)]
pub(crate) enum Access {
    /// No token is configured: anyone who reaches the console reads,
    /// nobody changes anything.
    ReadOnly,
    /// The right bearer token.
    Bearer,
    /// A browser session; its mutations need [`Auth::csrf`] of `session`.
    Session {
        /// The signed part of the cookie.
        session: String,
        /// The CSRF token its forms carry.
        csrf: String,
    },
}

impl Access {
    /// The CSRF token forms must carry (empty when none is needed).
    pub(crate) fn csrf(&self) -> &str {
        match self {
            Access::Session { csrf, .. } => csrf,
            Access::ReadOnly | Access::Bearer => "",
        }
    }

    /// Whether mutations are possible at all.
    pub(crate) fn may_change(&self) -> bool {
        !matches!(self, Access::ReadOnly)
    }

    /// Who did it, for the log line of a mutation.
    pub(crate) fn who(&self) -> &'static str {
        match self {
            Access::ReadOnly => "anonymous",
            Access::Bearer => "bearer token",
            Access::Session { .. } => "browser session",
        }
    }
}

impl Auth {
    pub(crate) fn new(token: Option<Token>, secure_cookie: bool) -> Auth {
        let key: [u8; 32] = rand::random();
        let token_tag = token.map(|t| mac(&key, b"token", t.0.as_bytes()));
        Auth {
            token_tag,
            key,
            secure_cookie,
        }
    }

    /// Whether `presented` is the token, in constant time.
    fn is_token(&self, presented: &str) -> bool {
        let Some(expected) = &self.token_tag else {
            return false;
        };
        keyed(&self.key, b"token", presented.as_bytes())
            .verify_slice(expected)
            .is_ok()
    }

    fn sign(&self, session: &str) -> Vec<u8> {
        mac(&self.key, b"session", session.as_bytes())
    }

    /// The CSRF token of a session.
    fn csrf(&self, session: &str) -> String {
        B64.encode(mac(&self.key, b"csrf", session.as_bytes()))
    }

    /// A fresh session cookie's value.
    fn new_session(&self) -> String {
        let nonce: [u8; 18] = rand::random();
        let session = format!("{}.{}", Utc::now().timestamp(), B64.encode(nonce));
        format!("{session}.{}", B64.encode(self.sign(&session)))
    }

    /// The session a cookie value proves, if its tag holds and it has not
    /// expired.
    fn session(&self, cookie: &str) -> Option<String> {
        let (session, tag) = cookie.rsplit_once('.')?;
        let tag = B64.decode(tag).ok()?;
        keyed(&self.key, b"session", session.as_bytes())
            .verify_slice(&tag)
            .ok()?;
        let issued: i64 = session.split_once('.')?.0.parse().ok()?;
        let age = Utc::now().timestamp() - issued;
        (0..SESSION_SECONDS).contains(&age).then(|| session.to_owned())
    }

    /// Whether a posted CSRF token is the session's, in constant time.
    fn csrf_holds(&self, session: &str, posted: &str) -> bool {
        B64.decode(posted).is_ok_and(|tag| {
            keyed(&self.key, b"csrf", session.as_bytes())
                .verify_slice(&tag)
                .is_ok()
        })
    }

    fn cookie(&self, value: &str, max_age: i64) -> String {
        // `Secure` would make a browser drop the cookie over plain HTTP,
        // which is what loopback (tests, an SSH tunnel) speaks.
        let secure = if self.secure_cookie { "; Secure" } else { "" };
        format!("{COOKIE}={value}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age}{secure}")
    }
}

/// An HMAC-SHA256 keyed with `key`, over `label`, a zero byte and `data`:
/// the labels keep the session, CSRF and token MACs apart.
fn keyed(key: &[u8], label: &[u8], data: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(label);
    mac.update(&[0]);
    mac.update(data);
    mac
}

fn mac(key: &[u8], label: &[u8], data: &[u8]) -> Vec<u8> {
    keyed(key, label, data).finalize().into_bytes().to_vec()
}

/// Finds what the request may do and puts it in the request's extensions;
/// refuses it (401) when a token is set and the request proves none. The
/// login page and the stylesheet are open.
pub(crate) async fn guard(
    State(auth): State<std::sync::Arc<Auth>>,
    mut request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path();
    if path == "/login" || path == "/admin.css" {
        return next.run(request).await;
    }
    let access = if auth.token_tag.is_none() {
        Some(Access::ReadOnly)
    } else if let Some(bearer) = bearer(&request) {
        if !auth.is_token(bearer) {
            tracing::warn!(path, "admin: wrong bearer token");
            return (StatusCode::UNAUTHORIZED, "wrong token\n").into_response();
        }
        Some(Access::Bearer)
    } else {
        cookie(&request)
            .and_then(|c| auth.session(c))
            .map(|session| Access::Session {
                csrf: auth.csrf(&session),
                session,
            })
    };
    match access {
        Some(access) => {
            request.extensions_mut().insert(access);
            next.run(request).await
        }
        None => login_form(StatusCode::UNAUTHORIZED, None),
    }
}

/// Checks that `access` may change rows with this form: a token is set,
/// and a browser session posted its CSRF token. Some: the refusal to send,
/// on a page framed by `frame`.
pub(crate) fn refusal(auth: &Auth, frame: &view::Frame, access: &Access, form: &Params) -> Option<Response> {
    let refuse = |message: &str| view::message_page(StatusCode::FORBIDDEN, "Refused", access, frame, message);
    match access {
        Access::ReadOnly => Some(refuse(
            "This console is read-only: start `outbox admin` with --admin-token (or OUTBOX_ADMIN_TOKEN) to requeue or give up on dead letters.",
        )),
        Access::Bearer => None,
        Access::Session { session, .. } => {
            if auth.csrf_holds(session, form.get("csrf").unwrap_or("")) {
                None
            } else {
                tracing::warn!("admin: mutation refused: missing or wrong CSRF token");
                Some(refuse(
                    "Missing or wrong CSRF token: go back, reload the page and try again.",
                ))
            }
        }
    }
}

fn bearer(request: &Request) -> Option<&str> {
    let value = request.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .map(str::trim)
}

fn cookie(request: &Request) -> Option<&str> {
    request
        .headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix(COOKIE)?.strip_prefix('='))
}

/// `GET /login`.
pub(crate) async fn login_page(State(auth): State<std::sync::Arc<Auth>>) -> Response {
    if auth.token_tag.is_none() {
        return Redirect::to("/").into_response();
    }
    login_form(StatusCode::OK, None)
}

fn login_form(status: StatusCode, problem: Option<&str>) -> Response {
    let body = html! {
        h1 { "outbox admin" }
        @if let Some(problem) = problem { p.error { (problem) } }
        form.login method="post" action="/login" {
            label for="token" { "Admin token" }
            input #token type="password" name="token" autocomplete="current-password" autofocus;
            button type="submit" { "Sign in" }
        }
    };
    (status, view::bare("Sign in", body)).into_response()
}

/// `POST /login`: the token from the form; a session cookie if it is right.
pub(crate) async fn login(State(auth): State<std::sync::Arc<Auth>>, body: axum::body::Bytes) -> Response {
    if auth.token_tag.is_none() {
        return Redirect::to("/").into_response();
    }
    let form = Params::parse(&body);
    if !auth.is_token(form.get("token").unwrap_or("")) {
        tracing::warn!("admin: sign-in with a wrong token");
        return login_form(StatusCode::UNAUTHORIZED, Some("Wrong token."));
    }
    tracing::info!("admin: browser session started");
    let cookie = auth.cookie(&auth.new_session(), SESSION_SECONDS);
    let mut response = Redirect::to("/").into_response();
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

/// `POST /logout`: forgets the cookie in this browser. The session itself
/// stays valid until it expires or the console restarts (nothing is stored
/// to revoke), so the form needs the CSRF token like any mutation.
pub(crate) async fn logout(
    State(auth): State<std::sync::Arc<Auth>>,
    axum::Extension(access): axum::Extension<Access>,
    body: axum::body::Bytes,
) -> Response {
    let frame = view::Frame {
        label: String::new(),
        base: None,
        fleet: false,
    };
    if let Some(refused) = refusal(&auth, &frame, &access, &Params::parse(&body)) {
        return refused;
    }
    let mut response = Redirect::to("/login").into_response();
    if let Ok(value) = HeaderValue::from_str(&auth.cookie("", 0)) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

/// Adds the security headers to every response.
pub(crate) async fn security_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth() -> Auth {
        Auth::new(Token::new("0123456789abcdef".into()), false)
    }

    #[test]
    fn tokens_sessions_and_csrf_tokens_verify_and_forgeries_do_not() {
        let a = auth();
        assert!(a.is_token("0123456789abcdef"));
        assert!(!a.is_token("0123456789abcdeF"));
        assert!(!a.is_token(""));
        let cookie = a.new_session();
        let session = a.session(&cookie).expect("a fresh cookie holds");
        assert!(a.csrf_holds(&session, &a.csrf(&session)));
        assert!(!a.csrf_holds(&session, ""));
        assert!(!a.csrf_holds(&session, &a.csrf("1.other")));
        // Another process's key, an edited timestamp, an expired session.
        assert!(auth().session(&cookie).is_none());
        let (issued, rest) = cookie.split_once('.').unwrap();
        assert!(
            a.session(&format!("{}.{rest}", issued.parse::<i64>().unwrap() + 1))
                .is_none()
        );
        let old = format!("{}.nonce", Utc::now().timestamp() - SESSION_SECONDS - 1);
        assert!(
            a.session(&format!("{old}.{}", B64.encode(a.sign(&old))))
                .is_none()
        );
    }

    #[test]
    fn short_tokens_are_refused_and_tokens_never_print() {
        assert!(Token::new("short".into()).is_none());
        let t = Token::new("0123456789abcdef".into()).unwrap();
        assert_eq!(format!("{t:?}"), "Token(<redacted>)");
    }
}
