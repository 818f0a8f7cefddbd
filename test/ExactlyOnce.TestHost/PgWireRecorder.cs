using System.Buffers.Binary;
using System.Collections.Concurrent;
using System.Net;
using System.Net.Sockets;
using System.Text;

namespace ExactlyOnce.TestHost;

/// <summary>
/// A loopback TCP relay in front of PostgreSQL that reads the frontend side of the wire protocol: what the client actually
/// sent, whichever layer sent it (EF Core, the inbox store's own commands, Npgsql's BEGIN/COMMIT/SAVEPOINT). Each
/// <c>Sync</c> (extended protocol) or <c>Query</c> (simple protocol) asks the server for a ReadyForQuery; a round trip is one
/// of them after which the client waits: nothing more of its bytes has arrived when the message is read, which is before
/// the relay forwards it, so before the server could have answered it. Npgsql sends <c>BEGIN</c> and <c>SAVEPOINT</c> as a
/// <c>Query</c> written in front of the next command, in the same write: those ask for a ReadyForQuery but cost no wait.
/// Statements are the texts of <c>Parse</c> and <c>Query</c> messages, and of a <c>Bind</c> to a prepared statement
/// (named, parsed earlier on the same connection, so its text is known even when it was parsed before a reset).
/// </summary>
/// <remarks>
/// Needs an unencrypted connection (<c>SSL Mode=Disable</c>): it cannot read TLS. Relies on one client write arriving
/// whole on loopback, true of the small messages measured here.
/// </remarks>
public sealed class PgWireRecorder : IAsyncDisposable
{
    private const int SslRequestCode = 80877103;
    private const int GssRequestCode = 80877104;
    private readonly TcpListener _listener = new(IPAddress.Loopback, 0);
    private readonly CancellationTokenSource _stop = new();
    private readonly ConcurrentDictionary<string, int> _statements = new();
    private readonly ConcurrentDictionary<string, int> _roundTrips = new();
    private readonly string _serverHost;
    private readonly int _serverPort;
    private readonly Task _accepting;
    private int _roundTripCount;
    private int _syncOrQueryCount;
    private readonly ConcurrentDictionary<string, int> _preparedExecutions = new();

    public PgWireRecorder(string serverHost, int serverPort)
    {
        _serverHost = serverHost;
        _serverPort = serverPort;
        _listener.Start();
        _accepting = AcceptAsync();
    }

    public int Port => ((IPEndPoint)_listener.LocalEndpoint).Port;

    /// <summary>Stops counting what came before: a measurement starts here.</summary>
    public void Reset()
    {
        Volatile.Write(ref _roundTripCount, 0);
        Volatile.Write(ref _syncOrQueryCount, 0);
        _statements.Clear();
        _roundTrips.Clear();
        _preparedExecutions.Clear();
    }

    /// <summary>Statements executed from a prepared (named) statement since <see cref="Reset"/>, by text: these were not parsed again.</summary>
    public IReadOnlyDictionary<string, int> PreparedExecutions => _preparedExecutions;

    /// <summary>Times a client waited for the server since <see cref="Reset"/>.</summary>
    public int RoundTrips => Volatile.Read(ref _roundTripCount);

    /// <summary><c>Sync</c> and <c>Query</c> messages since <see cref="Reset"/>: round trips plus the ones sent ahead of a command.</summary>
    public int SyncOrQueryMessages => Volatile.Read(ref _syncOrQueryCount);

    /// <summary>Each distinct statement text sent since <see cref="Reset"/>, with how many times it was sent.</summary>
    public IReadOnlyDictionary<string, int> Statements => new Dictionary<string, int>(_statements);

    /// <summary>Each distinct round trip since <see cref="Reset"/> (its statements in order, those sent ahead of it included), with how many times it was made.</summary>
    public IReadOnlyDictionary<IReadOnlyList<string>, int> RoundTripShapes =>
        _roundTrips.ToDictionary(pair => (IReadOnlyList<string>)pair.Key.Split('\u0001'), pair => pair.Value);

    public async ValueTask DisposeAsync()
    {
        await _stop.CancelAsync();
        _listener.Stop();
        try
        {
            await _accepting;
        }
        catch (Exception exception) when (exception is OperationCanceledException or SocketException or ObjectDisposedException)
        {
        }

        _stop.Dispose();
    }

    private async Task AcceptAsync()
    {
        while (!_stop.IsCancellationRequested)
        {
            var client = await _listener.AcceptTcpClientAsync(_stop.Token);
            _ = RelayAsync(client);
        }
    }

    private async Task RelayAsync(TcpClient client)
    {
        using (client)
        using (var server = new TcpClient())
        {
            try
            {
                await server.ConnectAsync(_serverHost, _serverPort, _stop.Token);
                client.NoDelay = true;
                server.NoDelay = true;
                NetworkStream fromServer = client.GetStream();
                var toServer = server.GetStream();
                var backwards = toServer.CopyToAsync(fromServer, _stop.Token);
                await ReadFrontendAsync(fromServer, toServer);
                await backwards;
            }
            catch (Exception exception) when (exception is IOException or SocketException or OperationCanceledException or ObjectDisposedException)
            {
                // A connection closed by either side, or the recorder stopping: nothing to count.
            }
        }
    }

    /// <summary>Forwards the client's bytes unchanged, message by message, recording round trips and statement texts.</summary>
    private async Task ReadFrontendAsync(NetworkStream client, Stream server)
    {
        // Start-up: untyped messages (length, code) until the StartupMessage itself; an SSL or GSS request is refused by a
        // server without TLS here only if the client asked: with SSL Mode=Disable none is sent.
        while (true)
        {
            byte[] header = await ReadExactlyAsync(client, 8);
            int length = BinaryPrimitives.ReadInt32BigEndian(header);
            int code = BinaryPrimitives.ReadInt32BigEndian(header.AsSpan(4));
            byte[] rest = await ReadExactlyAsync(client, length - 8);
            await server.WriteAsync(header, _stop.Token);
            await server.WriteAsync(rest, _stop.Token);
            if (code is not SslRequestCode and not GssRequestCode)
            {
                break;
            }
        }

        var pending = new List<string>(); // statements of the round trip being assembled on this connection
        var prepared = new Dictionary<string, string>(StringComparer.Ordinal); // this connection's named statements
        while (true)
        {
            byte[] header = await ReadExactlyAsync(client, 5);
            int length = BinaryPrimitives.ReadInt32BigEndian(header.AsSpan(1));
            byte[] body = await ReadExactlyAsync(client, length - 4);
            switch ((char)header[0])
            {
                case 'S': // Sync
                    EndOfRequest(client, pending);
                    break;
                case 'Q': // Query (simple protocol)
                    string query = CString(body, 0);
                    Record(query);
                    pending.Add(query);
                    EndOfRequest(client, pending);
                    break;
                case 'P': // Parse: statement name, then the text
                    string name = CString(body, 0);
                    string text = CString(body, Array.IndexOf(body, (byte)0) + 1);
                    if (name.Length > 0)
                    {
                        // Preparing: recorded when it is executed (Bind), as every later execution will be.
                        prepared[name] = text;
                        break;
                    }

                    Record(text);
                    pending.Add(text);
                    break;
                case 'B': // Bind: portal name, then statement name
                    string statement = CString(body, Array.IndexOf(body, (byte)0) + 1);
                    if (statement.Length > 0 && prepared.TryGetValue(statement, out string? preparedText))
                    {
                        Record(preparedText);
                        _preparedExecutions.AddOrUpdate(preparedText, 1, static (_, n) => n + 1);
                        pending.Add(preparedText);
                    }

                    break;
            }

            await server.WriteAsync(header, _stop.Token);
            await server.WriteAsync(body, _stop.Token);
        }
    }

    private void Record(string statement) => _statements.AddOrUpdate(statement, 1, static (_, n) => n + 1);

    // Not yet forwarded, so not yet answered: whatever of the client's bytes is already here was sent without waiting.
    private void EndOfRequest(NetworkStream client, List<string> statements)
    {
        Interlocked.Increment(ref _syncOrQueryCount);
        if (!client.DataAvailable)
        {
            RecordRoundTrip(statements);
        }
    }

    private void RecordRoundTrip(List<string> statements)
    {
        Interlocked.Increment(ref _roundTripCount);
        _roundTrips.AddOrUpdate(string.Join('\u0001', statements), 1, static (_, n) => n + 1);
        statements.Clear();
    }

    private static string CString(byte[] buffer, int start) =>
        Encoding.UTF8.GetString(buffer, start, Array.IndexOf(buffer, (byte)0, start) - start);

    private async Task<byte[]> ReadExactlyAsync(Stream stream, int count)
    {
        byte[] buffer = new byte[count];
        await stream.ReadExactlyAsync(buffer, _stop.Token);
        return buffer;
    }
}
